"""The row-invariant attention kernel (ygg_runtime/backend/csrc/attention.cpp): right against a plain
float64 reference, and a row's bits independent of everything but its own query and visible keys."""

import os
import subprocess
import sys

import pytest
import torch

from ygg_runtime.backend import native


def reference(q, k, v, mask):
    """softmax(q k^T / sqrt(d)) v over each row's visible slots, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k[:, :, : mask.shape[1]].transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v[:, :, : mask.shape[1]]


def attend(q, k, v, mask):
    """The kernel over k, v [1, KV, S, D] with a mask [W, <= S]: every row's view given as its tree
    window from slot 0 (lo = hi = 0). The call's own new rows are written past S, where no row looks."""
    (_, kv, s, d), w = k.shape, q.shape[2]
    cache = torch.zeros(1, 2, kv, s + w, d, dtype=k.dtype)
    cache[0, 0, :, :s], cache[0, 1, :, :s] = k[0], v[0]
    zeros = torch.zeros(w, dtype=torch.long)
    new = torch.randn(1, kv, w, d).to(k.dtype)
    return native.attention(q, new, new.clone(), cache, 0, torch.arange(s, s + w), zeros, zeros.clone(), mask)


def inputs(heads=12, kv=2, dim=128, width=8, slots=300, span=270, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, width, heads, dim, generator=g) * 2).to(dtype).transpose(1, 2)  # strided, as the model's
    k = torch.randn(1, kv, slots, dim, generator=g).to(dtype)
    v = torch.randn(1, kv, slots, dim, generator=g).to(dtype)
    mask = torch.rand(width, span, generator=g) < 0.6
    mask[:, 0] = True
    return q, k, v, mask


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
@pytest.mark.parametrize("heads,kv,dim", [(12, 2, 128), (9, 3, 64), (12, 1, 24), (4, 4, 16)])
def test_kernel_matches_a_float64_reference(dtype, tol, heads, kv, dim):
    """GQA groups of 1 to 12 heads (more than the 8 scored together), a head dim that is not a
    multiple of 16, rows seeing 1 to 270 slots."""
    q, k, v, mask = inputs(heads, kv, dim, dtype=dtype)
    mask[0] = False
    mask[0, 5] = True  # one row sees a single slot
    out = attend(q, k, v, mask)
    assert out.dtype == dtype and out.shape == q.shape
    assert (out.double() - reference(q, k, v, mask)).abs().max() < tol


def test_a_rows_bits_depend_only_on_its_query_and_the_keys_it_sees_in_order():
    """The same row computed alone, among other rows, with its keys spread over a wider span
    with masked slots (holes) between them, and on one thread: bitwise the same."""
    q, k, v, mask = inputs(width=16)
    base = attend(q, k, v, mask)
    row = 5
    visible = mask[row].nonzero().flatten()
    # alone, and at every width
    for w in (1, 2, 3, 7):
        rows = [row] + [r for r in range(16) if r != row][: w - 1]
        out = attend(q[:, :, rows].contiguous(), k, v, mask[rows])
        assert torch.equal(out[:, :, 0], base[:, :, row])
    # the same keys, in the same order, moved to other slots with masked slots between them
    slots = torch.sort(torch.randperm(700, generator=torch.Generator().manual_seed(1))[: len(visible)]).values
    k2 = torch.randn(1, 2, 700, 128).to(k.dtype)
    v2 = torch.randn(1, 2, 700, 128).to(v.dtype)
    k2[:, :, slots], v2[:, :, slots] = k[:, :, visible], v[:, :, visible]
    m2 = torch.zeros(1, 700, dtype=torch.bool)
    m2[0, slots] = True
    assert torch.equal(attend(q[:, :, [row]].contiguous(), k2, v2, m2)[:, :, 0], base[:, :, row])
    threads = torch.get_num_threads()
    try:  # one thread and two (the test workers may run with one)
        torch.set_num_threads(1)
        assert torch.equal(attend(q, k, v, mask), base)
        torch.set_num_threads(2)
        assert torch.equal(attend(q, k, v, mask), base)
    finally:
        torch.set_num_threads(threads)


def test_rows_of_sequences_in_other_regions_are_scored_as_alone():
    """A batched forward: four sequences' rows, each seeing only its own region of the cache (a
    prefix and its own tree rows). Every row has the bits it has in a forward of its own
    sequence, and matches the float64 reference."""
    q, k, v, _ = inputs(width=16, slots=1200, span=1200)
    mask = torch.zeros(16, 1200, dtype=torch.bool)
    regions = [(0, 100), (301, 90), (517, 250), (900, 7)]  # (base, committed): unaligned
    for i, (base, committed) in enumerate(regions):
        rows = range(4 * i, 4 * i + 4)
        mask[rows, base : base + committed] = True
        for j, r in enumerate(rows):  # a chain of four tree rows after the prefix
            mask[r, base + committed : base + committed + j + 1] = True
    batched = attend(q, k, v, mask)
    assert (batched.double() - reference(q, k, v, mask)).abs().max() < 2e-2
    for i in range(4):
        rows = list(range(4 * i, 4 * i + 4))
        alone = attend(q[:, :, rows].contiguous(), k, v, mask[rows])
        assert torch.equal(alone, batched[:, :, rows])


def test_a_prefix_range_and_tree_window_give_the_bits_of_the_same_view_as_a_mask():
    """What the model passes (a sequence's prefix [lo, hi), its tree window from hi) and the same
    view spelled as a mask: bitwise the same rows, whatever the region's place and the cache's size;
    and the call's new keys are written before any row reads them (a tree row sees itself)."""
    g = torch.Generator().manual_seed(3)
    heads, kv, d, w = 12, 2, 128, 6
    q = (torch.randn(1, w, heads, d, generator=g) * 2).to(torch.bfloat16).transpose(1, 2)
    new_k = torch.randn(1, kv, w, d, generator=g).to(torch.bfloat16)
    new_v = torch.randn(1, kv, w, d, generator=g).to(torch.bfloat16)
    prefix = torch.randn(2, kv, 333, d, generator=g).to(torch.bfloat16)
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0], [1, 0, 1, 0, 1, 0], [1, 1, 0, 1, 0, 1]], dtype=torch.bool)
    outs = []
    for base, size in ((0, 400), (17, 400), (1000, 5000)):  # unaligned, and a much larger cache
        cache = torch.zeros(3, 2, kv, size, d, dtype=torch.bfloat16)
        cache[1, :, :, base : base + 333] = prefix
        start = base + 333
        lo, hi = torch.full((w,), base), torch.full((w,), start)
        outs.append(native.attention(q, new_k, new_v, cache, 1, torch.arange(start, start + w), lo, hi, tree))
        assert torch.equal(cache[1, 0, :, start : start + w], new_k[0])
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
    mask = torch.zeros(w, 333 + w, dtype=torch.bool)
    mask[:, :333], mask[:, 333:] = True, tree
    k = torch.cat([prefix[0], new_k[0]], 1)[None]
    v = torch.cat([prefix[1], new_v[0]], 1)[None]
    assert torch.equal(attend(q, k, v, mask), outs[0])
    assert (outs[0].double() - reference(q, k, v, mask)).abs().max() < 2e-2


def _calls() -> list[tuple]:
    """Calls of every kind the lanes could split differently: 1 to 8 heads a block (GQA groups of 3,
    6, 7 and 12), head dims of 128, 64 and 40 (not a multiple of the vector), 1 to 17 rows, rows
    seeing a prefix, a tree window, both or nothing, keys ending mid-block, every dtype."""
    g = torch.Generator().manual_seed(7)
    calls = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for heads, kv, d in ((12, 2, 128), (14, 2, 64), (9, 3, 40), (24, 2, 64)):
            for w, committed in ((1, 0), (1, 37), (3, 300), (17, 121)):
                q = (torch.randn(1, w, heads, d, generator=g) * 3).to(dtype).transpose(1, 2)
                new_k, new_v = (torch.randn(1, kv, w, d, generator=g).to(dtype) for _ in range(2))
                cache = torch.randn(2, 2, kv, committed + w + 21, d, generator=g).to(dtype)
                tree = torch.rand(w, w + 5, generator=g) < 0.5
                tree[torch.arange(w), torch.arange(w) + 5] = True  # each row sees itself
                tree[0] = False  # and the first sees its prefix alone (nothing when there is none)
                slots = torch.arange(committed + 5, committed + 5 + w)
                calls.append((q, new_k, new_v, cache, 1, slots, torch.full((w,), min(3, committed)), torch.full((w,), committed), tree))
    return calls


def _attend_all(calls: list[tuple]) -> list[torch.Tensor]:
    return [native.attention(*c[:3], c[3].clone(), *c[4:]) for c in calls]


def test_an_avx2_build_gives_this_builds_bits(tmp_path):
    """The library built without AVX-512, as for an AVX2 CPU (8-lane vectors where this machine may
    have 16), computes every row with the same bits: the kernel's arithmetic is lane by lane, so
    the vector width never enters. Built into the suite's kernel cache (test_quant's AVX2 test
    builds the same library)."""
    lib = native.build(isa=["-mavx2", "-mfma", "-mf16c"])
    calls = _calls()
    torch.save(calls, tmp_path / "calls.pt")
    script = (f"import torch; from ygg_runtime.backend import native; native.load(r'{lib}');"
              f"import tests.test_kernel as t; torch.save(t._attend_all(torch.load(r'{tmp_path / 'calls.pt'}')), "
              f"r'{tmp_path / 'out.pt'}')")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr
    theirs = torch.load(tmp_path / "out.pt")
    ours = _attend_all(calls)
    assert len(theirs) == len(ours) == 48
    assert all(torch.equal(a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32),
                           b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32)) for a, b in zip(theirs, ours))


def test_a_row_outside_the_cache_is_refused():
    cache = torch.zeros(1, 2, 2, 100, 16)
    q, new = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    one = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.attention(q, new, new, cache, 0, torch.tensor([99]), torch.tensor([0]), torch.tensor([100]), one)


def test_kernel_is_cached_and_refuses_a_missing_compiler(monkeypatch, tmp_path):
    from ygg_runtime.errors import YggError

    first = native.build()  # the suite's kernel cache (built by the first test that needed it)
    assert first.is_file() and native.build() == first  # built once per source, torch and flags
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    with pytest.raises(YggError, match="no C\\+\\+ compiler"):
        native.build(tmp_path / "other")


def test_the_instruction_set_flags_are_inductors_and_probed_once_per_machine(monkeypatch, tmp_path):
    """The kernels are built with the flags Inductor compiles this machine's code with; asking
    Inductor costs seconds (its import, a probe compile per ISA), so the answer is cached, and asked
    again where what decides it changes (here ATEN_CPU_CAPABILITY)."""
    from torch._inductor import cpu_vec_isa

    monkeypatch.setenv("YGG_CACHE", str(tmp_path))
    isa = cpu_vec_isa.pick_vec_isa()
    want = [f for f in isa.build_arch_flags().split() if f.startswith("-m") and not f.startswith("-march")]
    assert native.vector_isa() == (str(isa) or None, want) and len(list((tmp_path / "kernels").glob("isa-*.json"))) == 1

    def probe():
        raise AssertionError("asked Inductor again")

    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", probe)
    assert native.isa_flags() == want and native.vector_isa()[0] == (str(isa) or None)  # from the cache
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    with pytest.raises(AssertionError, match="asked Inductor again"):
        native.isa_flags()


def test_processes_needing_the_same_build_compile_it_once(tmp_path):
    """Two processes that find no library (two compiles, or the suite's two workers, on a fresh
    machine) take turns on a lock: one runs the compiler, the other loads its library. The
    compiler here is a stand-in (CXX) that writes empty objects and logs each link of an empty
    library, slowly."""
    import os
    import subprocess
    import sys

    cxx = tmp_path / "cxx"
    cxx.write_text("#!/bin/sh\n"  # (Inductor's own probes of the compiler's ISA pass through to g++)
                   f"case \"$*\" in *kernels.so*) echo build >> {tmp_path / 'log'}; sleep 2;; */csrc/*) ;; "
                   "*) exec g++ \"$@\";; esac\n"
                   "while [ $# -gt 1 ]; do [ \"$1\" = -o ] && : > \"$2\"; shift; done\n")
    cxx.chmod(0o755)
    script = f"from ygg_runtime.backend import native; print(native.build(r'{tmp_path / 'cache'}'))"
    env = {**os.environ, "CXX": str(cxx)}
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(paths) == 1
    assert (tmp_path / "log").read_text().splitlines() == ["build"]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [os.path.basename(paths.pop())]  # no lock or part left
