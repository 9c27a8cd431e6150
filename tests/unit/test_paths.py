"""Where the templates (prompts/) and registries (configs/) are read from: the one copy at the top
of the repository in a checkout, the packaged copy (r2med_agent/_data/) in a wheel, and never
another checkout's folders."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from r2med_agent.paths import DATA_FOLDERS, configs_dir, data_dir, prompts_dir

ROOT = Path(__file__).resolve().parents[2]

_WHERE = ("from r2med_agent.prompts import templates as prompt_templates; from r2med_agent.paths import configs_dir, prompts_dir; "
          "print(prompts_dir()); print(configs_dir()); "
          "print(prompt_templates.render('hyde/qa.j2', query='QQ', domain='biology').splitlines()[0])")


def _where(path_entry: Path, cwd: Path) -> list[str]:
    """prompts_dir(), configs_dir() and the first line of a rendered template, in a fresh process
    that imports r2med_agent from ``path_entry`` only (no editable install on the way)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "R2MED_PROMPTS_DIR")}
    env["PYTHONPATH"] = str(path_entry)
    # -P: not the working folder first; -S: no site-packages, so the venv's editable install of another checkout cannot answer;
    # the package's own dependencies come back through the parent's sys.path after path_entry.
    deps = os.pathsep.join(p for p in sys.path if "site-packages" in p)
    code = f"import sys; sys.path[1:1] = {deps.split(os.pathsep)!r}; {_WHERE}"
    done = subprocess.run([sys.executable, "-S", "-P", "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _copy_checkout(dest: Path) -> Path:
    """A second checkout: the package, pyproject.toml and both data folders."""
    for name in ("r2med_agent", *DATA_FOLDERS):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_a_checkout_reads_its_own_top_level_folders():
    assert prompts_dir() == ROOT / "prompts" == data_dir("prompts")
    assert configs_dir() == ROOT / "configs" == data_dir("configs")
    assert (prompts_dir() / "hyde" / "qa.j2").is_file() and (configs_dir() / "llms.yaml").is_file()
    with pytest.raises(ValueError, match="no data folder 'resources'"):
        data_dir("resources")


def test_a_second_checkout_is_not_read(tmp_path):
    """Two checkouts on one machine: each process renders from the checkout it imports, whichever
    folder it runs in."""
    other = _copy_checkout(tmp_path / "other")
    template = other / "prompts" / "hyde" / "qa.j2"
    template.write_text("OTHER CHECKOUT {{ query }}\n", encoding="utf-8")
    mine = _where(ROOT, cwd=other)
    assert mine[:2] == [str(ROOT / "prompts"), str(ROOT / "configs")]
    assert not mine[2].startswith("OTHER CHECKOUT")
    theirs = _where(other, cwd=ROOT)
    assert theirs == [str(other / "prompts"), str(other / "configs"), "OTHER CHECKOUT QQ"]


def _tracked(repo: Path, folder: str) -> set[str]:
    out = subprocess.run(["git", "ls-files", folder], cwd=repo, capture_output=True, text=True, check=True).stdout
    return {line[len(folder) + 1:] for line in out.splitlines()}


def test_a_wheel_from_a_clean_clone_carries_every_template_and_yaml(tmp_path):
    """``git clone`` of this repository, ``pip wheel``: the wheel holds every file of prompts/ and
    configs/ under r2med_agent/_data/, and the package installed from it reads that copy."""
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: no clean clone to build from")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", "-w", str(tmp_path / "dist"), str(clone)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    wheel = next((tmp_path / "dist").glob("r2med_agent-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    for folder in DATA_FOLDERS:
        tracked = _tracked(clone, folder)
        assert tracked and any(n.endswith((".j2", ".yaml")) for n in tracked)
        packaged = {n[len(f"r2med_agent/_data/{folder}/"):] for n in names
                    if n.startswith(f"r2med_agent/_data/{folder}/")}
        assert packaged == tracked, folder
    site = tmp_path / "site"
    assert _where(site, cwd=tmp_path)[:2] == [str(site / "r2med_agent/_data/prompts"),
                                               str(site / "r2med_agent/_data/configs")]
