"""``lordo-export``'s refusals: each names the argument, the value and the fix, and touches no file."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_lordo.lightning.export import main


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_a_directory_or_a_shard_as_the_source_is_refused_with_the_file_to_pass(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "step=6.ckpt.lordo-abc123"
    folder.mkdir()
    (folder / "rank-0.pt").write_bytes(b"shard")
    err = refused([str(folder), str(tmp_path / "out.ckpt")], capsys)
    assert "source" in err and "is a directory: pass the checkpoint file" in err
    err = refused([str(folder / "rank-0.pt"), str(tmp_path / "out.ckpt")], capsys)
    assert "is one rank's shard" in err and repr(str(tmp_path / "step=6.ckpt")) in err
    assert "source" in refused([str(tmp_path / "missing.ckpt"), str(tmp_path / "out.ckpt")], capsys)
    assert not (tmp_path / "out.ckpt").exists()


def test_an_existing_target_is_kept_unless_forced_and_a_directory_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source, target = tmp_path / "a.ckpt", tmp_path / "other.ckpt"
    source.write_bytes(b"not read")
    target.write_bytes(b"another run's checkpoint")
    err = refused([str(source), str(target)], capsys)
    assert f"target {str(target)!r} exists: pass --force" in err
    assert target.read_bytes() == b"another run's checkpoint"
    err = refused([str(source), str(tmp_path)], capsys)
    assert "is a directory: name the file to write" in err


def test_a_file_that_is_no_checkpoint_is_refused_by_name_and_left_as_it_is(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "notes.ckpt"
    source.write_bytes(b"these are my notes, not a checkpoint")
    err = refused([str(source), str(tmp_path / "out.ckpt")], capsys)
    assert f"source {str(source)!r} cannot be read as a checkpoint" in err and "Traceback" not in err
    assert source.read_bytes() == b"these are my notes, not a checkpoint"
    assert not (tmp_path / "out.ckpt").exists()
