"""Registries: YAML layers into frozen dataclasses, user entries, unknown keys as errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from r2med_agent import config
from r2med_agent.errors import ConfigError


@dataclass(frozen=True)
class Thing:
    name: str
    size: int = 1
    ratio: float = 0.5
    tags: tuple[str, ...] = ()
    mode: str | None = None


@pytest.fixture
def layers(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "things.yaml").write_text("a:\n  size: 2\nb:\n  ratio: 1\n  tags: [x, y]\n")
    monkeypatch.setattr(config, "configs_dir", lambda: pkg)
    yield tmp_path
    config.set_user_config(None)


def test_package_layer_builds_frozen_entries(layers):
    reg = config.load_registry("things", Thing)
    assert reg["a"] == Thing("a", size=2)
    assert reg["b"].ratio == 1.0 and isinstance(reg["b"].ratio, float)
    assert reg["b"].tags == ("x", "y")


def test_user_layer_adds_and_replaces_entries(layers):
    user = layers / "user.yaml"
    user.write_text("things:\n  a:\n    size: 7\n  mine:\n    mode: fast\n")
    config.set_user_config(user)
    reg = config.load_registry("things", Thing)
    assert reg["a"].size == 7 and reg["mine"].mode == "fast" and "b" in reg


def test_unknown_key_names_file_and_key(layers):
    user = layers / "user.yaml"
    user.write_text("things:\n  a:\n    sise: 7\n")
    config.set_user_config(user)
    with pytest.raises(ConfigError, match=r"user\.yaml: things\.a: unknown key\(s\) sise; allowed: "):
        config.load_registry("things", Thing)


def test_bad_type_and_bad_yaml(layers):
    user = layers / "user.yaml"
    user.write_text("things:\n  a:\n    size: big\n")
    config.set_user_config(user)
    with pytest.raises(ConfigError, match="things.a.size: expected an integer"):
        config.load_registry("things", Thing)
    user.write_text("things:\n  a: [\n")
    config.load_yaml.cache_clear()
    with pytest.raises(ConfigError, match=r"user\.yaml:\d+: malformed YAML"):
        config.load_registry("things", Thing)


def test_unknown_entry_lists_known_names(layers):
    with pytest.raises(ConfigError, match="unknown thing 'zzz'; known: a, b"):
        config.lookup("things", Thing, "zzz")


def test_missing_user_file_is_an_error(layers):
    config.set_user_config(layers / "nope.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        config.load_registry("things", Thing)


def test_unknown_top_level_section_names_file_line_and_key(layers):
    user = layers / "user.yaml"
    user.write_text("things:\n  a:\n    size: 7\nthing:\n  b:\n    size: 1\n")
    config.set_user_config(user)
    with pytest.raises(ConfigError) as err:
        config.load_registry("things", Thing)
    assert str(err.value) == f"{user}:4: unknown top-level section(s) 'thing'; allowed: things"


def test_the_real_sections_are_the_package_registries(tmp_path):
    from r2med_agent.llm.registry import load_llm_specs

    assert config.user_sections() == ("encoders", "llms", "rerankers", "tasks")
    user = tmp_path / "user.yaml"
    user.write_text("encoders: {}\nllm:\n  mine: {backend: local, model: x.gguf}\n")
    config.set_user_config(user)
    with pytest.raises(ConfigError, match=r"user\.yaml:2: unknown top-level section\(s\) 'llm'; allowed: encoders, llms"):
        load_llm_specs()


def _alias_bomb(levels: int, width: int = 9) -> str:
    """A few lines whose aliases repeat each level ``width`` times: ``width ** levels`` leaves."""
    lines = ["llms:", f"  l0: &l0 [{', '.join(['lol'] * width)}]"]
    for n in range(1, levels):
        lines.append(f"  l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


def _bytes_bomb(text_kb: int = 10, levels: int = 5, width: int = 10) -> str:
    """One ``text_kb`` kB string repeated through ``width`` aliases per level: a 10 kB file of
    111,110 nodes (under the node limit) that expands to a gigabyte of text (issue 29 item 3)."""
    lines = ["llms:", "  bomb:", "    backend: openai", "    model: m",
             "    base_url: http://127.0.0.1:9/v1", "    extra_body:", f'      s: &s "{"x" * (text_kb * 1000)}"']
    previous = "s"
    for n in range(levels):
        anchor = f" &l{n}" if n < levels - 1 else ""
        lines.append(f"      l{n}:{anchor} [{', '.join([f'*{previous}'] * width)}]")
        previous = f"l{n}"
    return "\n".join(lines) + "\n"


def test_a_bytes_bomb_is_refused_by_the_text_its_aliases_repeat(tmp_path, capsys):
    """Before: read in 10 ms, then ``run --config`` copied and hashed the gigabyte (2.2 GB of
    memory in 23 s before it failed for other reasons; 10.6 GB in 3 minutes with data)."""
    import time

    from r2med_agent.cli import main

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_bytes_bomb(), encoding="utf-8")
    assert bomb.stat().st_size < 11_000
    with pytest.raises(ConfigError, match=r"bomb\.yaml:10: refused YAML: its aliases repeat more than "
                                          r"10,000,000 characters of text"):
        config.read_yaml(bomb)
    t0 = time.perf_counter()
    code = main(["run", "--config", str(bomb), "--task", "Biology", "--method", "hyde", "--llm", "bomb",
                 "--data-dir", str(tmp_path / "data")])
    assert time.perf_counter() - t0 < 10
    err = capsys.readouterr().err
    assert code == 2, err
    assert "bomb.yaml:10: refused YAML: its aliases repeat more than 10,000,000 characters" in err
    assert "Traceback" not in err
    # Text repeated within the limit still loads: 10 aliases of a 10 kB string are 100 kB.
    fine = tmp_path / "fine.yaml"
    fine.write_text(_bytes_bomb(levels=1), encoding="utf-8")
    assert len(config.read_yaml(fine)["llms"]["bomb"]["extra_body"]["l0"]) == 10


def test_an_alias_bomb_is_refused_with_its_line_before_it_is_built(tmp_path, capsys):
    from r2med_agent.cli import main

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb(8), encoding="utf-8")  # 43 million leaves in 9 lines
    with pytest.raises(ConfigError, match=r"bomb\.yaml:8: refused YAML: its aliases expand it beyond 1,000,000"):
        config.read_yaml(bomb)
    # The same file as a user config stops the CLI with that line, no traceback.
    assert main(["llms", "--config", str(bomb)]) == 2
    err = capsys.readouterr().err
    assert "bomb.yaml:8: refused YAML" in err and "Traceback" not in err
    # Many small aliases are refused by their number, at the first one past the limit.
    many = tmp_path / "many.yaml"
    many.write_text("base: &b {x: 1}\n" + "".join(f"k{n}: *b\n" for n in range(config.MAX_YAML_ALIASES + 1)),
                    encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"many\.yaml:{config.MAX_YAML_ALIASES + 2}: refused YAML: more than 100 aliases"):
        config.read_yaml(many)
    # A file with a few aliases (the package's encoders.yaml has some) still loads.
    few = tmp_path / "few.yaml"
    few.write_text("base: &b {x: 1}\none: *b\ntwo: {<<: *b, y: 2}\n", encoding="utf-8")
    assert config.read_yaml(few) == {"base": {"x": 1}, "one": {"x": 1}, "two": {"x": 1, "y": 2}}
