import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vqattn.codebook import Codebook
from vqattn.functional import vq_attention

CENTRES = torch.tensor([[3.0, 0.0], [-3.0, 0.0], [0.0, 3.0], [0.0, -3.0], [2.5, 2.5]])


def mixture_keys(n, generator, noise=0.1):
    z = torch.randint(len(CENTRES), (n,), generator=generator)
    return (CENTRES[z] + noise * torch.randn(n, 2, generator=generator)).view(1, 1, n, 2)


def test_ema_kmeans_recovers_gaussian_mixture_centres():
    # k-means has local minima: over seeds 0..39, one run (seed 0) parked a code between two clusters.
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(1)
    # Twice as many codes as centres, so that a k-means local minimum cannot leave a centre uncovered.
    codebook = Codebook(1, 2 * len(CENTRES), 2, decay=0.9, dead_code_threshold=5.0)
    for _ in range(150):
        codebook(mixture_keys(1024, g))
    codes, usage = codebook.codes[0], codebook.ema_counts[0]
    distances = torch.cdist(CENTRES, codes)  # (centres, codes)
    assert distances.min(dim=0).values.max() < 0.3, codes  # every code sits inside a cluster
    owner = distances.argmin(dim=0)  # codes split a cluster: their usage-weighted mean is its centre
    for i, centre in enumerate(CENTRES):
        mine = owner == i
        assert mine.any(), f"no code for centre {centre}"
        mean = (codes[mine] * usage[mine, None]).sum(0) / usage[mine].sum()
        assert (mean - centre).norm() < 0.02, (centre, codes[mine])
    stats = codebook.usage_stats()
    assert stats["perplexity"] > len(CENTRES)
    assert stats["dead_codes"] == 0
    assert stats["quant_error"] < 2 * 0.1**2  # below E‖noise‖² in 2-D: codes split clusters


def test_dead_codes_are_restarted_on_recent_keys():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    codebook = Codebook(1, 8, 2, decay=0.5, data_init=False, dead_code_threshold=1.0)
    with torch.no_grad():
        codebook.codes.copy_(torch.full((1, 8, 2), 100.0))  # far from every key: all dead
        codebook.codes[0, 0] = 0.0
        codebook.ema_sums.copy_(codebook.codes)
    codebook(mixture_keys(512, g))  # every code but 0 unused: usage decays below the threshold
    codebook(mixture_keys(512, g))  # ... and this step restarts them from the batch
    keys = mixture_keys(512, g)
    codebook(keys)
    distance_to_data = torch.cdist(codebook.codes[0, 1:], keys[0, 0]).min(dim=1).values
    assert distance_to_data.max() < 3.0  # were ~140 away before the restart
    assert codebook.usage_stats()["dead_codes"] == 0
    assert codebook.usage_stats()["perplexity"] > 4


def test_eval_mode_does_not_update():
    codebook = Codebook(2, 4, 3).eval()
    before = codebook.codes.clone()
    codebook(torch.randn(1, 2, 10, 3))
    assert torch.equal(before, codebook.codes) and not bool(codebook.initialized)


def test_commitment_loss_and_gradient_learning():
    torch.manual_seed(0)
    k = torch.randn(2, 2, 16, 4, requires_grad=True)
    ema = Codebook(2, 8, 4, commitment=0.5)
    codes, assignment, aux = ema(k)
    assert torch.equal(assignment.index, torch.cdist(k.detach(), codes.expand(2, -1, -1, -1)).argmin(-1))
    nearest = torch.gather(codes.expand(2, -1, -1, -1), 2,
                           torch.cdist(k.detach(), codes.expand(2, -1, -1, -1)).argmin(-1)[..., None].expand(-1, -1, -1, 4))
    torch.testing.assert_close(aux, 0.5 * (k.detach() - nearest).pow(2).mean())
    aux.backward()
    torch.testing.assert_close(k.grad, 0.5 * 2 * (k.detach() - nearest) / k.numel())
    assert not codes.requires_grad  # EMA codes learn without gradients

    # gradient learning: the commitment loss moves the keys, the codebook loss E(sg k, c) the codes
    k.grad = None
    learned = Codebook(2, 8, 4, learning="grad", commitment=0.5)
    codes, assignment, aux = learned(k)
    nearest = codes.expand(2, -1, -1, -1).gather(2, assignment.index[..., None].expand(-1, -1, -1, 4))
    expected = 0.5 * (k - nearest.detach()).pow(2).mean() + (k.detach() - nearest).pow(2).mean()
    torch.testing.assert_close(aux, expected)
    aux.backward()
    k_ref, codes_ref = k.detach().clone().requires_grad_(), learned.codes.detach().clone().requires_grad_()
    nearest_ref = codes_ref.expand(2, -1, -1, -1).gather(2, assignment.index[..., None].expand(-1, -1, -1, 4))
    (0.5 * (k_ref - nearest_ref.detach()).pow(2).mean() + (k_ref.detach() - nearest_ref).pow(2).mean()).backward()
    torch.testing.assert_close(k.grad, k_ref.grad)
    torch.testing.assert_close(learned.codes.grad, codes_ref.grad)


def test_soft_codebook_learns_codes_and_temperature_through_attention():
    torch.manual_seed(0)
    codebook = Codebook(2, 8, 4, assign="soft", learn_temperature=True, temperature=0.5)
    q, k, v = (torch.randn(1, 2, 20, 4) for _ in range(3))
    codes, _, aux = codebook(k)
    out = vq_attention(q, k, v, codes, causal=True, assign=codebook.assign, temperature=codebook.temperature,
                       block_len=8)
    (out.square().sum() + aux).backward()
    assert codebook.codes.grad.abs().sum() > 0
    assert codebook.log_temperature.grad.abs().sum() > 0
    torch.testing.assert_close(codebook.temperature, torch.full((2,), 0.5))


@pytest.mark.parametrize("needs", ["keys", "codes", "both"])
@pytest.mark.parametrize("key_weight,code_weight", [(1.0, 1.0), (0.25, 1.0), (0.5, 0.0)])
def test_quantisation_loss_matches_the_mean_squared_distance_to_the_code_with_gradients(needs, key_weight,
                                                                                        code_weight):
    from vqattn.codebook import quantisation_loss

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 13, 5, generator=g, dtype=torch.float64)
    codes = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)
    index = torch.randint(0, 6, (2, 3, 13), generator=g)
    index[0, 0, :4] = 2  # a code chosen by several keys: its gradient and statistics add them all
    index[:, 1] = 0  # a head with every code but one empty
    keys.requires_grad_(needs in ("keys", "both"))
    codes.requires_grad_(needs in ("codes", "both"))
    inputs = [x for x in (keys, codes) if x.requires_grad]
    loss, error, counts, sums = quantisation_loss(keys, codes, index, key_weight=key_weight, code_weight=code_weight)
    nearest = codes[torch.arange(3).view(1, 3, 1), index]  # (B, H, T, D), the naive gather
    expected_error = ((keys - nearest) ** 2).mean()
    expected = (key_weight * ((keys - nearest.detach()) ** 2).mean()
                + code_weight * ((keys.detach() - nearest) ** 2).mean())
    torch.testing.assert_close(error, expected_error.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    one_hot = torch.nn.functional.one_hot(index, 6).to(keys.dtype)  # (B, H, T, S)
    torch.testing.assert_close(counts, one_hot.sum((0, 2)), rtol=0, atol=0)
    torch.testing.assert_close(sums, torch.einsum("bhts,bhtd->hsd", one_hot, keys.detach()), rtol=1e-13, atol=1e-13)
    grad = torch.tensor(0.37, dtype=torch.float64)
    for got, want in zip(torch.autograd.grad(loss, inputs, grad), torch.autograd.grad(expected, inputs, grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_quantisation_loss_of_half_keys_equals_their_float32_copy(half):
    """Half keys (a layer's under autocast) accumulate in the codes' float32: the loss, error and statistics equal
    those of the keys' exact float32 copy, and the keys' gradient is that copy's rounded to the keys' dtype, in their
    memory order. A strided view, as a layer's keys are (one of its projections)."""
    from vqattn.codebook import quantisation_loss
    from vqattn.ops.utils import memory_order

    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 13, 2, 3, 8, generator=g).to(half)[:, :, 1].transpose(1, 2)  # (B, H, T, D), strided
    codes, index = torch.randn(3, 6, 8, generator=g), torch.randint(0, 6, (2, 3, 13), generator=g)
    exact = keys.float().requires_grad_()
    keys.requires_grad_()
    got, want = (quantisation_loss(k, codes, index, key_weight=0.25, code_weight=0.0) for k in (keys, exact))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    grad, = torch.autograd.grad(got[0], keys)
    want_grad, = torch.autograd.grad(want[0], exact)
    assert grad.dtype == half and torch.equal(grad, want_grad.to(half))
    assert memory_order(grad) == memory_order(keys)  # written in the keys' (token-major) order


def test_quantisation_error_of_keys_on_their_codes_is_zero_not_negative():
    from vqattn.codebook import quantisation_loss

    codes = torch.randn(2, 4, 8) * 100  # large norms: the expanded form cancels to rounding error
    index = torch.randint(0, 4, (3, 2, 9))
    keys = codes[torch.arange(2).view(1, 2, 1), index]
    error = quantisation_loss(keys, codes, index)[1]
    assert 0 <= error <= 1e-3 * codes.square().mean()


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_codes"):
        Codebook(2, 0, 4)
    with pytest.raises(ValueError, match="assign"):
        Codebook(2, 4, 4, assign="kernel")
    with pytest.raises(ValueError, match="decay"):
        Codebook(2, 4, 4, decay=1.0)
    with pytest.raises(ValueError, match="temperature"):
        Codebook(2, 4, 4, temperature=0.0)
    with pytest.raises(ValueError, match="H=2 and D=4"):
        Codebook(2, 4, 4)(torch.randn(1, 3, 5, 4))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank, world, port, result_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(100 + rank)  # different data, and different restart draws, on each rank
    g = torch.Generator().manual_seed(rank)
    codebook = Codebook(1, 6, 2, decay=0.8, data_init=True, dead_code_threshold=2.0)
    collectives = []
    for name in ("all_reduce", "broadcast", "all_gather"):
        original = getattr(dist, name)
        setattr(dist, name, lambda *a, _f=original, _n=name, **kw: (collectives.append(_n), _f(*a, **kw))[1])
    for _ in range(20):
        codebook(mixture_keys(256, g, noise=0.3 * (rank + 1)))
    torch.save({"codes": codebook.codes, "counts": codebook.ema_counts, "collectives": collectives},
               f"{result_path}.{rank}")
    dist.destroy_process_group()


def _single_process_ema(batches, init_codes, decay):
    codebook = Codebook(1, len(init_codes), 2, decay=decay, data_init=False, dead_code_threshold=0.0)
    with torch.no_grad():
        codebook.codes.copy_(init_codes[None])
        codebook.ema_sums.copy_(init_codes[None])
    for keys in batches:
        codebook(keys)
    return codebook


@pytest.mark.slow  # seconds a case
def test_ddp_ranks_with_different_data_hold_identical_codebooks(tmp_path):
    """Two gloo processes see different keys; all-reduced EMA statistics keep their codebooks identical."""
    world, result = 2, str(tmp_path / "codes")
    mp.start_processes(_ddp_worker, args=(world, _free_port(), result), nprocs=world, join=True,
                       start_method="spawn")
    r0, r1 = torch.load(f"{result}.0"), torch.load(f"{result}.1")
    assert torch.equal(r0["codes"], r1["codes"]) and torch.equal(r0["counts"], r1["counts"])
    assert r0["collectives"] == r1["collectives"] == ["all_reduce"] * 20  # one collective per step
    # The shared codebook fits both ranks' data: a code near every mixture centre.
    assert torch.cdist(CENTRES, r0["codes"][0]).min(dim=1).values.max() < 0.5


def test_all_reduced_ema_equals_ema_on_the_union_of_batches(monkeypatch):
    """What the ranks compute jointly is the EMA k-means step on all their keys (simulated all_reduce)."""
    import copy

    import vqattn.codebook as cb_module

    g = torch.Generator().manual_seed(0)
    init = CENTRES + 0.5
    rank_batches = [[mixture_keys(64, g) for _ in range(5)] for _ in range(2)]
    union = _single_process_ema([torch.cat(b, 2) for b in zip(*rank_batches)], init, decay=0.7)

    # Two replicas stepped in lockstep; the all-reduce sums the flat statistics both would send.
    replicas = [_single_process_ema([], init, decay=0.7) for _ in range(2)]
    monkeypatch.setattr(cb_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(cb_module.dist, "get_world_size", lambda: 2)
    for step in range(5):
        sent = []
        monkeypatch.setattr(cb_module, "_all_reduce_sum", lambda flat: sent.append(flat.clone()))
        for rank, (replica, batches) in enumerate(zip(replicas, rank_batches)):
            monkeypatch.setattr(cb_module.dist, "get_rank", lambda rank=rank: rank)
            copy.deepcopy(replica)(batches[step])  # what this rank would send
        assert len(sent) == 2  # one collective per step and rank
        total = sent[0] + sent[1]
        monkeypatch.setattr(cb_module, "_all_reduce_sum", lambda flat: flat.copy_(total))
        for replica, batches in zip(replicas, rank_batches):
            replica(batches[step])
    for replica in replicas:
        torch.testing.assert_close(replica.codes, union.codes)


@pytest.mark.parametrize("assign", ["hard", "soft"])
def test_autocast_keeps_assignment_and_statistics_in_float32(assign):
    """Under bf16 autocast the distances (and so the argmin) must not be rounded to bf16."""
    torch.manual_seed(0)
    reference = Codebook(2, 16, 8, assign=assign)
    mixed = Codebook(2, 16, 8, assign=assign)
    mixed.load_state_dict(reference.state_dict())
    for step in range(3):
        k = torch.randn(2, 2, 32, 8)
        torch.manual_seed(100 + step)  # both draw the same restart candidates
        expected = reference(k)
        torch.manual_seed(100 + step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = mixed(k)
        assert got.codes.dtype == torch.float32 and got.aux_loss.dtype == torch.float32
        if assign == "hard":
            assert torch.equal(got.assignment.index, expected.assignment.index)
        else:
            assert got.assignment.weights.dtype == torch.float32
            torch.testing.assert_close(got.assignment.weights, expected.assignment.weights, rtol=0, atol=1e-6)
    for name, buffer in mixed.named_buffers():
        if buffer.is_floating_point():
            assert buffer.dtype == torch.float32, name
            torch.testing.assert_close(buffer, reference.get_buffer(name), rtol=0, atol=1e-6)


def test_half_precision_module_keeps_float32_statistics():
    codebook = Codebook(2, 4, 8).bfloat16()
    assert codebook.codes.dtype == codebook.ema_counts.dtype == codebook.ema_sums.dtype == torch.float32
    out = codebook(torch.randn(1, 2, 10, 8, dtype=torch.bfloat16))
    assert out.codes.dtype == torch.bfloat16 and torch.isfinite(out.aux_loss)
    assert codebook.double().codes.dtype == torch.float64  # wider casts still apply
