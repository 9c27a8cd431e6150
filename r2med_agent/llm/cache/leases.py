"""Leases in the generation cache: who owns one, and whether that owner still works on it.

A lease names its owner (host, pid, the pid's start time, and a token per claim) and carries a
heartbeat the owner refreshes. On the same host the owner's process decides at once (gone, or a
pid now belonging to a process started at another time, means dead); from another host, a
heartbeat older than the lease's time to live. The SQL side is
:meth:`r2med_agent.llm.cache.store.GenerationCache.claim`; the waiting side,
:class:`SharedMisses`.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

LEASE_TTL_S = 600.0
"""Default lease time to live: a lease whose heartbeat is older counts as dead when its owner
runs on another host (on the same host the owner's pid decides at once)."""


def _proc_stat(pid: int) -> tuple[str, str]:
    """Process ``pid``'s state letter and start time (clock ticks since boot) from ``/proc``, or
    ``("", "")`` where they cannot be read; the pid with its start time names one process even
    after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "", ""
    # The command name (field 2) may hold spaces and parentheses; the fields after its last ")"
    # start with field 3 (the state), so field 22 (starttime) is the 20th of them.
    rest = stat[stat.rfind(")") + 2 :].split()
    return (rest[0], rest[19]) if len(rest) > 19 else ("", "")


def _pid_start(pid: int) -> str:
    return _proc_stat(pid)[1]


def _pid_alive(pid: int, start: str) -> bool:
    """Whether process ``pid`` runs on this host and is the one that started at ``start`` (a
    killed process its parent has not reaped yet, a zombie, is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    state, now = _proc_stat(pid)
    if state in ("Z", "X"):
        return False
    return not start or now == "" or now == start


@dataclass(frozen=True)
class LeaseOwner:
    """Who holds a lease: this host and process, and a token that tells one claim from another
    (two threads of one process never take each other's keys for their own).

    Attributes:
        host: the host name.
        pid: the owner's process id.
        pid_start: when that process started (see ``_pid_start``), "" where unknown.
        token: unique per claim.
    """

    host: str
    pid: int
    pid_start: str
    token: str

    @classmethod
    def new(cls) -> LeaseOwner:
        """A fresh owner for this process."""
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _pid_start(pid), uuid.uuid4().hex)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"


@dataclass(frozen=True)
class LeaseClaim:
    """What ``GenerationCache.claim`` found for each key asked for.

    Attributes:
        claimed: keys now leased to the caller (none had a row or a live lease), in input order.
        done: keys that already have a row (written since the caller last looked).
        held: keys leased by another live owner -> that owner.
    """

    claimed: list[str]
    done: list[str]
    held: dict[str, LeaseOwner]


def lease_live(lease: tuple[LeaseOwner, float], now: float, ttl_s: float) -> bool:
    """Whether a lease's owner still works on it: on this host, whether its process still runs;
    on another, whether its heartbeat is younger than ``ttl_s``."""
    owner, beat = lease
    if owner.host == socket.gethostname():
        return _pid_alive(owner.pid, owner.pid_start)
    return now - beat < ttl_s

