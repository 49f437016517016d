"""The CPU kernels (megatron_ext/cpu_kernels.py, csrc/cpu_kernels.c), compiled for real with this
machine's C compiler. Expert GEMMs: results against float64 references and torch's GEMM, a
row's bits independent of the other rows, a lone expert's weight giving the same bits as its
row in a stack, bad offsets refused. Decode attention: against SDPA on the pool's layouts, a
request's bits independent of the others and of the layout, nothing past its length read, bad
lengths and rows refused. The build's cache and fallbacks."""

import pytest
import torch
import torch.nn.functional as F

from megatron_ext import cpu_kernels


def _offs(counts):
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)


def test_the_kernel_builds_and_loads_on_this_machine():
    """CI's machine has a C compiler: the kernel must be what the rollout runs there (a
    missing compiler would silently put the experts back on the slower path)."""
    assert cpu_kernels.available(), "install a C compiler (gcc) or set CC"
    x, w = torch.randn(3, 8), torch.randn(2, 8, 16)
    assert cpu_kernels.handles(x, w)
    assert not cpu_kernels.handles(x.double(), w.double())  # float32 only
    column_major = w.transpose(1, 2).contiguous().transpose(1, 2)  # each [K, N] column-major
    offs = torch.tensor([1, 3], dtype=torch.int32)
    assert torch.equal(cpu_kernels.grouped_mm(x, column_major, offs), cpu_kernels.grouped_mm(x, w, offs))


@pytest.mark.parametrize("K,N", [(1, 1), (3, 15), (64, 16), (64, 47), (256, 48), (96, 50),
                                 (256, 384), (192, 256)])
@pytest.mark.parametrize("counts", [[9, 0, 8, 1], [0, 0, 0, 5], [17, 3, 0, 0], [0, 0, 0, 0]])
def test_grouped_mm_matches_float64_and_torch(K, N, counts):
    torch.manual_seed(K * 1000 + N)
    E = len(counts)
    x = torch.randn(sum(counts) + 2, K)  # 2 rows past the last offset: not computed
    w = torch.randn(E, K, N)
    offs = _offs(counts)
    out = cpu_kernels.grouped_mm(x, w, offs)
    assert out.shape == (x.shape[0], N) and out.dtype == torch.float32
    s = 0
    for e, n in enumerate(counts):  # against float64, and against torch's (MKL's) float32 GEMM
        ref = x[s:s + n].double() @ w[e].double()
        torch.testing.assert_close(out[s:s + n].double(), ref, rtol=1e-5, atol=1e-5 * K ** 0.5)
        torch.testing.assert_close(out[s:s + n], x[s:s + n] @ w[e], rtol=1e-5,
                                   atol=1e-5 * K ** 0.5)
        s += n


def test_a_rows_bits_do_not_depend_on_the_other_rows():
    """One in-order sum per element: a row alone, in a block of 8, past a block boundary, or
    with a different neighbour gives the same bits (MKL's may not)."""
    torch.manual_seed(3)
    K, N = 256, 384 + 16 + 5  # panels of 48, a vector of 16 and a scalar tail
    w = torch.randn(2, K, N)
    x = torch.randn(19, K)
    whole = cpu_kernels.grouped_mm(x, w, _offs([11, 8]))
    for i in range(19):
        e = 0 if i < 11 else 1
        alone = cpu_kernels.grouped_mm(x[i:i + 1], w[e:e + 1], _offs([1]))
        assert torch.equal(alone[0], whole[i]), f"row {i}"
    shuffled = x[torch.randperm(11)]
    again = cpu_kernels.grouped_mm(shuffled, w[:1], _offs([11]))
    for j, row in enumerate(shuffled):
        i = int((x[:11] == row).all(1).nonzero())
        assert torch.equal(again[j], whole[i])


@pytest.mark.parametrize("layout", ["out-in", "in-out"])
def test_a_lone_experts_weight_gives_its_stacks_bits(layout):
    """`linear(x, weight)` (F.linear's convention, a weight row-major or stored transposed)
    is the same bits as the weight's GEMM inside a stack: a borrowed expert run alone and an
    own expert run grouped agree exactly."""
    torch.manual_seed(4)
    stack = torch.randn(3, 64, 40)  # [E, in, out]
    x = torch.randn(7, 64)
    grouped = cpu_kernels.grouped_mm(x, stack, _offs([0, 7, 0]))
    weight = stack[1].t()  # [out, in], strides (1, out)
    if layout == "out-in":
        weight = weight.contiguous()  # row-major [out, in]
    assert torch.equal(cpu_kernels.linear(x, weight), grouped)
    assert cpu_kernels.linear(x.double(), weight.double()) is None  # not float32: torch's kernels


@pytest.mark.parametrize("counts", [[4, 2], [3, 9]])  # decreasing; past the rows
def test_bad_offsets_are_refused(counts):
    x, w = torch.randn(6, 8), torch.randn(2, 8, 16)
    offs = torch.tensor(counts, dtype=torch.int32)
    with pytest.raises(ValueError, match="offsets"):
        cpu_kernels.grouped_mm(x, w, offs)
    with pytest.raises(ValueError, match="2 experts"):
        cpu_kernels.grouped_mm(x, w, offs[:1])


def test_build_caches_by_hash_and_warns_without_a_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib = cpu_kernels.build()
    assert lib is not None and lib.parent == tmp_path / "flexfloor" / "kernels"
    assert lib.suffix == ".so"
    stamp = lib.stat().st_mtime_ns
    assert cpu_kernels.build() == lib and lib.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in lib.parent.iterdir()] == [lib.name]  # no temporary file left
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))
    with pytest.warns(RuntimeWarning, match="no C compiler.*no-such-compiler-xyz"):
        assert cpu_kernels.build() is None
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.warns(RuntimeWarning, match="could not build the CPU kernels"):
        assert cpu_kernels.build() is None
    assert not list((tmp_path / "other" / "flexfloor" / "kernels").iterdir())  # nothing half-written


def test_switched_off_the_experts_run_on_torchs_kernels():
    """`rollout.cpu_kernels: false` reaches `PlacedMoE` as `kernels=False`: torch's GEMMs."""
    from megatron_ext.elastic_moe import _expert_linear, _grouped_mm

    x, w = torch.randn(5, 8), torch.randn(2, 8, 16)
    offs = torch.tensor([2, 5], dtype=torch.int32)
    assert torch.equal(_grouped_mm(x, w, offs, kernels=False), torch._grouped_mm(x, w, offs=offs))
    assert torch.equal(_grouped_mm(x, w, offs), cpu_kernels.grouped_mm(x, w, offs))
    weight = torch.randn(16, 8)
    assert torch.equal(_expert_linear(x, weight, kernels=False), F.linear(x, weight))
    assert torch.equal(_expert_linear(x, weight), cpu_kernels.linear(x, weight))


def _sdpa(q, keys, values, lengths, scale, rows=None):
    """The reference: SDPA with the mask position < length, GQA, each request's row of keys."""
    B, H, D = q.shape
    if rows is not None:
        keys, values = keys[rows], values[rows]
    keys, values = keys[:B], values[:B]
    L = keys.shape[2]
    seen = torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)
    mask = torch.zeros(B, 1, 1, L, dtype=q.dtype).masked_fill_(~seen.view(B, 1, 1, L), float("-inf"))
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask,
                                          scale=scale, enable_gqa=True).squeeze(2)


@pytest.mark.parametrize("B,H,G,D,L", [(1, 1, 1, 16, 1), (5, 4, 2, 64, 80), (3, 8, 2, 48, 33),
                                       (4, 6, 6, 17, 40), (32, 4, 2, 64, 160)])
def test_decode_attention_matches_sdpa(B, H, G, D, L):
    """Against SDPA over the pool's layouts: lane views (rows interleaving groups, the pool's
    [slots, G, D]) with requests in other lanes, and gathered [B, G, L, D] copies."""
    torch.manual_seed(B * 100 + L)
    lanes = B + 2
    store_k, store_v = torch.randn(lanes * L, G, D), torch.randn(lanes * L, G, D)
    keys = store_k.view(lanes, L, G, D).transpose(1, 2)  # [lanes, G, L, D], as `lane_views`
    values = store_v.view(lanes, L, G, D).transpose(1, 2)
    q = torch.randn(B, H, D)
    lengths = torch.randint(1, L + 1, (B,))
    lengths[0] = L  # one request reads the whole span
    rows = torch.randperm(lanes)[:B]
    scale = D ** -0.5
    got = cpu_kernels.decode_attention(q, keys, values, lengths, scale, rows=rows)
    torch.testing.assert_close(got, _sdpa(q, keys, values, lengths, scale, rows),
                               rtol=2e-5, atol=2e-6)
    gathered_k, gathered_v = keys[rows].contiguous(), values[rows].contiguous()
    alone = cpu_kernels.decode_attention(q, gathered_k, gathered_v, lengths, scale)
    assert torch.equal(alone, got)  # the layout does not change a bit
    # a request's result does not depend on the others: each one alone, the same bits
    for b in range(B):
        one = cpu_kernels.decode_attention(q[b:b + 1], keys, values, lengths[b:b + 1], scale,
                                           rows=rows[b:b + 1])
        assert torch.equal(one[0], got[b])
    # what lies past a request's length is not read
    past = store_k.clone().view(lanes, L, G, D)
    for b in range(B):
        past[rows[b], lengths[b]:] = float("nan")
    nan_keys = past.transpose(1, 2)
    assert torch.equal(cpu_kernels.decode_attention(q, nan_keys, values, lengths, scale,
                                                    rows=rows), got)


def test_decode_attention_refuses_bad_lengths_and_rows():
    q, k = torch.randn(2, 4, 16), torch.randn(3, 2, 8, 16)
    for lengths in ([0, 3], [9, 1]):
        with pytest.raises(ValueError, match="lengths"):
            cpu_kernels.decode_attention(q, k, k, torch.tensor(lengths), 0.25)
    with pytest.raises(ValueError, match="rows"):
        cpu_kernels.decode_attention(q, k, k, torch.tensor([1, 1]), 0.25, rows=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="multiple of the groups"):
        cpu_kernels.decode_attention(torch.randn(2, 3, 16), k, k, torch.tensor([1, 1]), 0.25)


def test_the_wrappers_refuse_what_the_kernels_cannot_read():
    """Called directly (not through `handles` / `runs_attention`), bad tensors are refused
    before the C code sees a pointer: no read past a tensor, no garbage."""
    x, w, offs = torch.randn(5, 8), torch.randn(2, 8, 16), torch.tensor([2, 5], dtype=torch.int32)
    for bad_x, bad_w in ((x.double(), w.double()), (torch.randn(5, 9), w), (x, w[0])):
        with pytest.raises(ValueError, match="float32 CPU tensors"):
            cpu_kernels.grouped_mm(bad_x, bad_w, offs)
    q, k, lengths = torch.randn(2, 4, 16), torch.randn(3, 2, 8, 16), torch.tensor([1, 2])
    for args in ((q.double(), k.double(), k.double()), (q, k.transpose(2, 3), k.transpose(2, 3)),
                 (torch.randn(2, 4, 32)[..., ::2], k, k)):
        with pytest.raises(ValueError, match="float32 CPU tensors"):
            cpu_kernels.decode_attention(*args, lengths, 0.25)
    with pytest.raises(ValueError, match="head sizes"):
        cpu_kernels.decode_attention(torch.randn(2, 4, 32), k, k, lengths, 0.25)
    with pytest.raises(ValueError, match="must match keys"):
        cpu_kernels.decode_attention(q, k, k.clone().transpose(0, 1).contiguous().transpose(0, 1),
                                     lengths, 0.25)


def test_a_library_that_does_not_load_falls_back_with_a_warning(tmp_path, monkeypatch, capsys):
    """A damaged file in the cache (or a cache on a noexec mount): a warning, torch's kernels."""
    from flexfloor.rollout import engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lib = cpu_kernels.build()
    lib.write_bytes(b"")  # damaged
    cpu_kernels._library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not load the CPU kernels"):
            assert not cpu_kernels.available()
        assert "could not load the CPU kernels" in cpu_kernels.unavailable_reason()
        # the engine says so on stderr (its runs ignore Python warnings): rank 0, once
        engine._say_if_kernels_missing.cache_clear()
        for rank in (1, 0, 0):
            engine._say_if_kernels_missing(rank)
        said = capsys.readouterr().err.splitlines()
        assert len(said) == 1 and said[0].startswith(
            "[flexfloor] warning: rollout.cpu_kernels: could not load the CPU kernels")
        from megatron_ext.elastic_moe import _grouped_mm

        x, w = torch.randn(5, 8), torch.randn(2, 8, 16)
        offs = torch.tensor([2, 5], dtype=torch.int32)
        assert torch.equal(_grouped_mm(x, w, offs), torch._grouped_mm(x, w, offs=offs))
    finally:
        monkeypatch.undo()
        cpu_kernels._library.cache_clear()
        engine._say_if_kernels_missing.cache_clear()
    assert cpu_kernels.available() and cpu_kernels.unavailable_reason() is None
