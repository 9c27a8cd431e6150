"""Values PyYAML's constructors cannot build (issue 39 item 12): an integer of more digits than
Python converts and a date that does not exist end in one line with the file and line, exit 2,
wherever a YAML file is read (one reader: config.read_yaml)."""

from __future__ import annotations

from pathlib import Path

import pytest

from r2med_agent.cli.app import main
from r2med_agent.config import read_yaml
from r2med_agent.errors import ConfigError

CASES = {
    "digits": ("llms:\n  mine:\n    max_tokens: " + "7" * 50_000 + "\n",
               "cannot read the value '" + "7" * 40 + "...': a number of 50,000 digits, more than Python converts"),
    "date": ("llms:\n  mine:\n    added: 2001-02-30\n", "cannot read the value '2001-02-30': day is out of range for month"),
    "nested date": ("tasks:\n  - [1, {when: 2001-13-01}]\n", "cannot read the value '2001-13-01': month must be in 1..12"),
}
LINES = {"digits": 3, "date": 3, "nested date": 2}


@pytest.mark.parametrize("case", list(CASES))
def test_read_yaml_names_the_file_and_line(tmp_path: Path, case: str) -> None:
    text, message = CASES[case]
    path = tmp_path / "user.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    assert str(err.value).startswith(f"{path}:{LINES[case]}: malformed YAML: {message}"), err.value


@pytest.mark.parametrize("case", ["digits", "date"])
def test_the_cli_says_it_in_one_line(tmp_path: Path, capsys, case: str) -> None:
    path = tmp_path / "user.yaml"
    path.write_text(CASES[case][0])
    assert main(["run", "--config", str(path), "--task", "sample", "-o", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{path}:3: malformed YAML: " in err
    assert len([x for x in err.splitlines() if x.strip()]) == 1, err
