"""The shared file and error helpers: atomic writes, hashing while copying, one-line messages."""

import hashlib
import io

import pytest

from ygg_runtime.errors import YggError, first_line
from ygg_runtime.files import output_dir, sha256_of, write_atomic


def test_sha256_of_files_is_the_hash_of_their_concatenation_and_copies_them(tmp_path):
    parts = [tmp_path / "a", tmp_path / "b"]
    parts[0].write_bytes(b"x" * (1 << 24) + b"tail")  # crosses a chunk boundary
    parts[1].write_bytes(b"second")
    seen = []
    copy = io.BytesIO()
    digest = sha256_of(parts, lambda label, done, total: seen.append((label, done, total)), "joining", copy_to=copy)
    data = parts[0].read_bytes() + parts[1].read_bytes()
    assert digest == hashlib.sha256(data).hexdigest()
    assert copy.getvalue() == data
    assert seen[-1] == ("joining", len(data), len(data))


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "results.json"
    write_atomic(path, b"old")

    with pytest.raises(TypeError):
        write_atomic(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"


def test_output_dir_refuses_a_path_under_a_file_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(YggError, match="cannot write figures to"):
        output_dir(tmp_path / "file" / "out", "figures")
    assert output_dir(tmp_path / "new" / "dir", "figures").is_dir()


def test_first_line_of_an_error_never_fails():
    assert first_line(ValueError("")) == "ValueError"
    assert first_line(RuntimeError("\n\n  second line is the first with text\nthird")) == "second line is the first with text"
    assert first_line(OSError("x" * 300), 10) == "x" * 10 + "…"
