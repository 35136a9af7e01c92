"""``--out`` files: a new file or an earlier output of the same command is written whole; any other
existing file is refused before the work and left as it was; a foreign file appearing meanwhile
sends the output to a free name beside it."""
import json
import os
import random
import subprocess
import sys

import pytest

from flashrt import conformance, tune
from flashrt.out_files import OutFile, first_line, json_report


def test_a_new_path_is_written_whole_and_an_earlier_output_replaced(tmp_path):
    path = tmp_path / "sub" / "report.json"
    out = OutFile(path, "flashrt demo", json_report("rows", "device"))
    out.check()
    first = {"rows": [random.random() for _ in range(5)], "device": "cpu"}
    assert out.write(json.dumps(first)) == path and json.loads(path.read_text()) == first
    again = OutFile(path, "flashrt demo", json_report("rows", "device"))
    again.check()  # its own earlier report: allowed
    second = {"rows": [random.random()], "device": "cpu"}
    assert again.write(json.dumps(second)) == path and json.loads(path.read_text()) == second
    assert sorted(os.listdir(path.parent)) == ["report.json"]  # no temporary left behind


@pytest.mark.parametrize("text", ['{"rows": []}', "[1, 2]", "not json", "# a profile\nname: x\n"])
def test_a_file_the_command_did_not_write_is_refused_and_kept(tmp_path, text):
    path = tmp_path / "mine.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"--out: expected a new file or one an earlier `flashrt demo` wrote, got "
                                         r".*mine\.json.*did not write"):
        OutFile(path, "flashrt demo", json_report("rows", "device")).check()
    assert path.read_text() == text


def test_a_directory_and_a_binary_file_are_refused(tmp_path):
    with pytest.raises(ValueError, match="a directory"):
        OutFile(tmp_path, "flashrt demo", first_line("#")).check()
    blob = tmp_path / "blob.yaml"
    data = bytes([0xFF, 0xFE, 0x00, 0x80]) + os.urandom(16)
    blob.write_bytes(data)
    with pytest.raises(ValueError, match="cannot read as text"):
        OutFile(blob, "flashrt demo", first_line("#")).check()
    assert blob.read_bytes() == data


def test_a_foreign_file_appearing_meanwhile_sends_the_output_beside_it(tmp_path):
    path = tmp_path / "tuned.yaml"
    out = OutFile(path, "flashrt demo", first_line("# by demo"))
    out.check()
    path.write_text("someone else's\n")  # appears while the command runs
    (tmp_path / "tuned.1.yaml").write_text("and another\n")
    written = out.write("# by demo\nx: 1\n")
    assert written == tmp_path / "tuned.2.yaml" and written.read_text() == "# by demo\nx: 1\n"
    assert path.read_text() == "someone else's\n" and (tmp_path / "tuned.1.yaml").read_text() == "and another\n"
    assert out.write("# by demo\nx: 2\n") == written  # later writes (checkpoints) keep that file


def test_the_commands_recognize_their_own_outputs(tmp_path):
    report = tmp_path / "conf.json"
    report.write_text(json.dumps({"device": "cpu", "rows": [], "passed": 0, "total": 0}))
    conformance.out_file(str(report)).check()
    profile = tmp_path / "tuned.yaml"
    profile.write_text(f"{tune.TUNED_BY} on cpu\nname: tuned\n")
    tune.out_file(str(profile)).check()
    profile.write_text(f"name: tuned\n{tune.TUNED_BY}\n")  # the marker not on the first line: not its output
    with pytest.raises(ValueError, match="flashrt tune"):
        tune.out_file(str(profile)).check()


@pytest.mark.parametrize("argv", [["conformance"], ["tune"], ["bench", "kernels"],
                                  ["jit", "compile", "--arch", "sm_90"]])
def test_the_cli_refuses_a_foreign_out_file_before_any_work(tmp_path, argv):
    path = tmp_path / "notes.txt"
    text = f"my notes {random.random()}\n"
    path.write_text(text)
    r = subprocess.run([sys.executable, "-m", "flashrt.cli", *argv, "--out", str(path)], capture_output=True,
                       text=True, cwd="/", timeout=120)
    assert path.read_text() == text and "Traceback" not in r.stderr, r.stderr
    if argv == ["bench", "kernels"] and "kernels: needs a CUDA device" in r.stderr:  # refused for that first
        assert r.returncode == 2
        return
    assert r.returncode == 2 and "--out: expected a new file or one an earlier" in r.stderr, r.stderr
