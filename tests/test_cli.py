"""The `deltazip` command: help and version, one-line errors for bad input, `info --verify`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_deltazip import __version__
from hf_deltazip.cli import build_parser, main
from hf_deltazip.format import DZ_FILENAME, DeltaZipFile

from dz_factory import small_delta


@pytest.fixture
def folder(tmp_path):
    folder = tmp_path / "delta"
    small_delta().save_pretrained(folder)
    return folder


def one_line_error(err: str) -> str:
    """The error output, after checking it is one line and no traceback."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("deltazip: error: "), err
    return lines[0]


def subcommands():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sorted(sub.choices)


def test_every_subcommand_has_help(capsys):
    names = subcommands()
    assert {"info", "compress", "push", "demo", "bench"} <= set(names)
    for argv in [[]] + [[name] for name in names] + [["bench", w] for w in ("quality", "kernels", "serve")]:
        with pytest.raises(SystemExit) as stop:
            main(argv + ["--help"])
        assert stop.value.code == 0, argv
        out = capsys.readouterr().out
        assert out.startswith("usage: deltazip"), (argv, out[:200])


def test_bench_quality_help_lists_the_settings_with_percent_signs(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "quality", "--help"])
    assert stop.value.code == 0
    assert "2-bit + 75% sparse" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"deltazip {__version__}"


def test_compress_out_pointing_at_a_file_is_a_one_line_error(tmp_path, capsys):
    out = tmp_path / "taken.txt"
    out.write_text("mine")
    rc = main(["compress", "--base", str(tmp_path / "b"), "--finetuned", str(tmp_path / "f"), "--out", str(out)])
    assert rc == 2
    line = one_line_error(capsys.readouterr().err)
    assert "is a file, not a folder" in line and str(out) in line
    assert out.read_text() == "mine"


def test_compress_missing_folders_and_calibration_files_are_named_before_any_model_loads(tmp_path, capsys):
    real = tmp_path / "real"
    real.mkdir()  # a folder, not a model: a load would fail later; these checks come first
    base = ["compress", "--out", str(tmp_path / "out")]
    assert main(base + ["--base", str(tmp_path / "nope"), "--finetuned", str(real)]) == 2
    assert f"--base {tmp_path / 'nope'}: no such folder" in one_line_error(capsys.readouterr().err)
    assert main(base + ["--base", str(real), "--finetuned", "./nope"]) == 2
    assert "--finetuned ./nope: no such folder" in one_line_error(capsys.readouterr().err)
    assert main(base + ["--base", str(real), "--finetuned", str(real), "--calibration", str(tmp_path / "c.jsonl")]) == 2
    assert "c.jsonl: no such file" in one_line_error(capsys.readouterr().err)
    (tmp_path / "c.csv").write_text("a,b")
    assert main(base + ["--base", str(real), "--finetuned", str(real), "--calibration", str(tmp_path / "c.csv")]) == 2
    assert "must be .jsonl" in one_line_error(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()

def test_compress_bad_config_file_is_a_one_line_error(tmp_path, capsys):
    args = ["compress", "--base", "b", "--finetuned", "f", "--out", str(tmp_path / "out")]
    assert main(args + ["--config", str(tmp_path / "missing.json")]) == 2
    assert "missing.json not found" in one_line_error(capsys.readouterr().err)
    (tmp_path / "bad.json").write_text("{bits: 4")
    assert main(args + ["--config", str(tmp_path / "bad.json")]) == 2
    assert "is not valid JSON" in one_line_error(capsys.readouterr().err)
    (tmp_path / "list.json").write_text("[4]")
    assert main(args + ["--config", str(tmp_path / "list.json")]) == 2
    assert "JSON object" in one_line_error(capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_bad_device_and_quality_are_refused_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["demo", "--device", "gpu0"])
    assert stop.value.code == 2 and "is not a device" in capsys.readouterr().err
    assert main(["push", str(tmp_path), "me/x", "--quality", "{gain: 1}"]) == 2
    assert "--quality is not JSON" in one_line_error(capsys.readouterr().err)


def test_unexpected_errors_are_one_line_unless_debugging(folder, monkeypatch, capsys):
    import hf_deltazip.format.folder as folder_module

    def broken(path):
        raise RuntimeError("something\nunexpected")

    monkeypatch.setattr(folder_module, "delta_bytes_report", broken)
    monkeypatch.delenv("DELTAZIP_DEBUG", raising=False)
    assert main(["info", str(folder)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "RuntimeError: something unexpected" in line and "DELTAZIP_DEBUG=1" in line
    monkeypatch.setenv("DELTAZIP_DEBUG", "1")
    with pytest.raises(RuntimeError, match="unexpected"):
        main(["info", str(folder)])


# --------------------------------------------------------------------------- info
def test_info_on_a_missing_path(tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "no such delta folder or .dz file" in one_line_error(capsys.readouterr().err)


def flip_payload_byte(path):
    """Flip one byte in the middle of the first stored tensor's payload; the header stays valid."""
    with DeltaZipFile(path) as dz:
        start, end = min(dz._spans.values())
    data = bytearray(path.read_bytes())
    data[(start + end) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_info_verify_finds_flipped_payload_bytes(folder, capsys):
    assert main(["info", str(folder), "--verify"]) == 0
    out = capsys.readouterr().out
    with DeltaZipFile(folder / DZ_FILENAME) as dz:
        n = len(dz.tensors)
    assert f"verified: {n} tensors match their checksums" in out
    assert main(["info", str(folder), "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verified_tensors"] == n

    flip_payload_byte(folder / DZ_FILENAME)
    assert main(["info", str(folder)]) == 0  # without --verify only the header is read
    capsys.readouterr()
    for target in (folder, folder / DZ_FILENAME):
        assert main(["info", str(target), "--verify"]) == 2
        captured = capsys.readouterr()
        line = one_line_error(captured.err)
        assert "corrupt" in line and str(folder / DZ_FILENAME) in line
        assert "verified" not in captured.out


def test_info_refuses_a_config_that_contradicts_the_header(folder, capsys):
    path = folder / "deltazip_config.json"
    config = json.loads(path.read_text())
    assert config["bits"] == 4
    path.write_text(json.dumps({**config, "bits": 2}))
    for argv in (["info", str(folder)], ["info", str(folder / DZ_FILENAME), "--verify"]):
        assert main(argv) == 2
        line = one_line_error(capsys.readouterr().err)
        assert "bits is 2 but delta.dz was compressed with 4" in line and "set bits=4" in line
    path.unlink()
    assert main(["info", str(folder)]) == 2  # a folder without its config is no delta folder
    assert "deltazip_config.json not found" in one_line_error(capsys.readouterr().err)
    assert main(["info", str(folder / DZ_FILENAME), "--verify"]) == 0  # a bare .dz file: only its checksums


def test_info_into_a_closed_pipe_exits_quietly(folder):
    proc = subprocess.Popen([sys.executable, "-m", "hf_deltazip.cli", "info", str(folder), "--verbose"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "DELTAZIP_DEBUG": ""})
    proc.stdout.close()  # the reader went away before deltazip wrote a byte, as `| head` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    assert "deltazip:" not in err, err  # quietly: the reader left, nothing went wrong


def test_console_script_reports_bad_input_in_one_line(tmp_path):
    out = tmp_path / "file"
    out.write_text("x")
    exe = os.path.join(os.path.dirname(sys.executable), "deltazip")
    if not os.path.exists(exe):
        pytest.skip("the deltazip console script is not installed beside this python")
    done = subprocess.run([exe, "compress", "--base", "b", "--finetuned", "f", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    # other libraries may warn on stderr while importing; deltazip's own report is one line
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("deltazip:")]
    assert line.startswith("deltazip: error: ") and "is a file, not a folder" in line


def test_compress_with_a_target_ratio_and_info_shows_each_choice(tmp_path, capsys):
    from hf_deltazip.format.folder import delta_bytes_report

    from model_factory import base_model, finetune

    base_model("llama").save_pretrained(tmp_path / "base")
    finetune("llama", 1).save_pretrained(tmp_path / "ft")
    (tmp_path / "cfg.json").write_text(json.dumps({"budget_bits": [2, 3, 4], "budget_sparsity": [None, 0.5, 0.75],
                                                   "budget_group_sizes": [-1, 64]}))
    out = tmp_path / "delta"
    assert main(["compress", "--base", str(tmp_path / "base"), "--finetuned", str(tmp_path / "ft"), "--out", str(out),
                 "--config", str(tmp_path / "cfg.json"), "--target-ratio", "3.4", "--budget-weighting", "output"]) == 0
    printed = capsys.readouterr().out
    from hf_deltazip.config import read_config_json

    assert read_config_json(out)["budget_weighting"] == "output"  # the plain OBS objective, as asked
    assert "(target 3.4x)" in printed and "resident on a GPU" in printed
    report = delta_bytes_report(out)
    assert abs(report["ratio"] / 3.4 - 1) <= 0.05
    assert main(["info", "--verbose", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "(target 3.4x)" in printed and "GPU bytes" in printed
    for m in report["modules"]:  # one row per module with the chosen bits, group size, layout and bytes
        row = next(line for line in printed.splitlines() if line.startswith(m["module"] + " "))
        assert row.split()[3:7] == [str(m["bits"]), str(m["group_size"]), m["sparsity"], str(m["bytes"])]


def test_compress_with_the_lowrank_layout_and_info_shows_its_bands(tmp_path, capsys):
    from hf_deltazip.format.folder import delta_bytes_report

    from model_factory import base_model, finetune

    base_model("llama").save_pretrained(tmp_path / "base")
    finetune("llama", 1).save_pretrained(tmp_path / "ft")
    out = tmp_path / "delta"
    assert main(["compress", "--base", str(tmp_path / "base"), "--finetuned", str(tmp_path / "ft"), "--out", str(out),
                 "--sparsity", "lowrank:2", "--bits", "8", "--group-size", "-1"]) == 0
    capsys.readouterr()
    report = delta_bytes_report(out)
    linear = [m for m in report["modules"] if ".layers." in m["module"]]
    assert linear and all(m["sparsity"].startswith("lowrank[") for m in linear)
    assert all(m["resident_bytes"] > m["bytes"] for m in linear)  # the GPU holds 8-bit codes, the file factors
    # the report's GPU bytes, worked out from the record alone, are those of the codes loading rebuilds
    from hf_deltazip.delta import CompressedDelta

    loaded = CompressedDelta.from_pretrained(out)
    for m in linear:
        served = loaded.modules[m["module"]]
        assert m["resident_bytes"] == sum(t.numel() * t.element_size() for t in (served.qweight, served.scales,
                                                                                 served.zeros)), m["module"]
    assert main(["info", "--verbose", str(out)]) == 0
    printed = capsys.readouterr().out
    for m in linear:
        row = next(line for line in printed.splitlines() if line.startswith(m["module"] + " "))
        assert row.split()[3:7] == [str(m["bits"]), str(m["group_size"]), m["sparsity"], str(m["bytes"])]
    assert main(["compress", "--base", str(tmp_path / "base"), "--finetuned", str(tmp_path / "ft"),
                 "--out", str(tmp_path / "bad"), "--sparsity", "lowrank:0"]) != 0
    assert "lowrank:x" in capsys.readouterr().err


def test_compress_calibration_text_needs_a_tokenizer_and_takes_one_from_the_flag(tmp_path, capsys):
    from hf_deltazip.bench.http import id_tokenizer

    from model_factory import VOCAB, base_model, finetune

    base_model("llama").save_pretrained(tmp_path / "base")
    finetune("llama", 1).save_pretrained(tmp_path / "ft")  # a model folder with no tokenizer in it
    (tmp_path / "calib.txt").write_text(" ".join(f"t{i % VOCAB}" for i in range(400)))
    args = ["compress", "--base", str(tmp_path / "base"), "--finetuned", str(tmp_path / "ft"), "--bits", "4",
            "--group-size", "-1", "--n-samples", "4", "--seq-len", "16", "--calibration", str(tmp_path / "calib.txt")]
    assert main(args + ["--out", str(tmp_path / "d1")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after the models' progress bars
    assert "calibration texts need a tokenizer" in line and "--tokenizer" in line
    assert not (tmp_path / "d1").exists()
    assert main(args + ["--out", str(tmp_path / "d2"), "--tokenizer", str(tmp_path / "nothing")]) == 2
    assert "--tokenizer" in capsys.readouterr().err.strip().splitlines()[-1]
    id_tokenizer(VOCAB).save_pretrained(tmp_path / "tok")
    assert main(args + ["--out", str(tmp_path / "d3"), "--tokenizer", str(tmp_path / "tok")]) == 0
    capsys.readouterr()
    assert (tmp_path / "d3" / "tokenizer.json").is_file()  # the delta carries the tokenizer it was calibrated with


def test_running_from_the_checkout_root_keeps_the_real_kernels_package():
    """`python -m hf_deltazip...` from the repository root puts the root on sys.path, where the checkout's kernels/
    folder would hide the Hugging Face `kernels` package that transformers 5.25+ imports; importing hf_deltazip
    first takes the root off the path, so transformers' models still import and `kernels` is not ours."""
    root = Path(__file__).resolve().parent.parent
    code = ("import sys, hf_deltazip; from transformers import LlamaForCausalLM; import hf_deltazip.kernels; "
            "m = sys.modules.get('kernels'); f = getattr(m, '__file__', None) or ''; "
            "print('OURS' if f.startswith(sys.argv[1]) else 'OK')")
    out = subprocess.run([sys.executable, "-c", code, str(root / "kernels")], cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "OK"
