"""The kernels' noise for draws by the largest of the logits plus noise (``hsd_gumbel``): splitmix64's uniforms
through two logarithms, the same for a key on every build and thread count, Gumbel-distributed, and what
:func:`~hsd_opt.runtime.sampling.gumbel_offsets` gives on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from hsd_opt.engine import kernels
from hsd_opt.runtime.sampling import LEAST_UNIFORM, gumbel_offsets

LIB = kernels.load()
pytestmark = pytest.mark.skipif(LIB is None or not kernels.has(LIB, "hsd_gumbel"),
                                reason="no C compiler here: the kernels cannot be built")

MASK = 2 ** 64 - 1


def _splitmix64(key: int, j: int) -> int:
    """splitmix64's output j + 1 from the state ``key`` (the published algorithm, in Python integers)."""
    z = (key + (j + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _reference(key: int, n: int, temperature: float) -> torch.Tensor:
    """The noise as the kernels' comment defines it, in float64: element j from output j's high 24 bits, element
    n - n//2 + j from its bits 31..8."""
    h = n - n // 2
    k = [0] * n
    for j in range(h):
        z = _splitmix64(key, j)
        k[j] = z >> 40
        if j < n // 2:
            k[h + j] = (z >> 8) & 0xFFFFFF
    u = torch.tensor(k, dtype=torch.float64) * 2.0 ** -24
    return -torch.log(-torch.log(u.clamp_min(LEAST_UNIFORM))) * temperature


def _noise(key: int, n: int, temperature: float, threads: int) -> torch.Tensor:
    out = torch.empty(n)
    LIB.hsd_gumbel(key, n, temperature, out.data_ptr(), threads)
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 49_153])
def test_the_noise_is_splitmix64s_uniforms_through_two_logarithms(n):
    """Each element is -log(-log u) * T of its uniform (within float32 rounding of the two logarithms), the key
    decides everything, and one or two threads give the same bits."""
    for key, t in ((0, 1.0), (MASK, 0.7), (0x0123456789ABCDEF, 1.3)):
        got = _noise(key, n, t, 1)
        want = _reference(key, n, t)
        assert torch.allclose(got.double(), want, rtol=2e-6, atol=2e-6), (n, key)
        assert torch.equal(got, _noise(key, n, t, 2))
    if n > 2:
        assert not torch.equal(_noise(1, n, 1.0, 1), _noise(2, n, 1.0, 1))


def test_a_zero_draw_gives_the_least_uniform_not_an_infinite_offset():
    """Key 0's first 2^25 values hold draws of 24 zero bits (one in 2^24); each gives the offset of u = 2^-25,
    finite, the least of all."""
    n, h = 2 ** 25, 2 ** 24
    out = _noise(0, n, 1.0, 2)
    assert torch.isfinite(out).all()
    least = out.min().item()
    assert abs(least - (-math.log(25 * math.log(2)))) < 1e-5
    zeros = (out == least).nonzero().flatten().tolist()
    assert zeros
    for i in zeros:
        z = _splitmix64(0, i if i < h else i - h)
        assert (z >> 40 if i < h else (z >> 8) & 0xFFFFFF) == 0
    del out


def test_the_logarithm_is_within_1_ulp_and_the_same_in_every_lane():
    """``hsd_log`` over positive normal floats (the noise's range and far beyond): within one unit in the last
    place of the exact value, and each element the same computed in a vector's lanes or alone."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(300_000, generator=g).clamp_min(2.0 ** -25),
                   torch.exp(torch.empty(100_000).uniform_(-80, 80, generator=g)),
                   torch.tensor([2.0 ** -126, 0.5, 0.70710677, 0.70710683, 1.0, 1.0000001, 2.0, 3e38])])
    y = torch.empty_like(x)
    LIB.hsd_log_rows(x.data_ptr(), x.numel(), y.data_ptr())
    exact = x.double().log()
    ulp = (exact.float().nextafter(torch.tensor(float("inf"))).double() - exact.float().double()).abs()
    assert ((y.double() - exact).abs() / ulp).max() <= 1
    assert y[x == 1.0].item() == 0.0
    alone = torch.empty(1)
    for i in torch.randint(0, x.numel(), (300,), generator=g).tolist():
        LIB.hsd_log_rows(x[i:].data_ptr(), 1, alone.data_ptr())
        assert alone.item() == y[i].item()


def test_the_noise_has_the_gumbel_distribution_and_a_wrong_one_fails():
    """Kolmogorov-Smirnov against the standard Gumbel over 10 keys x 49,152 values (each key's values also
    uncorrelated with the next key's and with their neighbours); the same test rejects noise off by a twentieth."""
    from scipy.stats import kstest

    samples = [_noise(key, 49_152, 1.0, 2).double() for key in range(10)]
    allv = torch.cat(samples)
    assert kstest(allv.numpy(), "gumbel_r").pvalue > 1e-3
    assert kstest((allv * 1.05).numpy(), "gumbel_r").pvalue < 1e-6
    for a, b in zip(samples, samples[1:]):
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.02
        assert abs(torch.corrcoef(torch.stack([a[:-1], a[1:]]))[0, 1]) < 0.02
        assert abs(torch.corrcoef(torch.stack([a[:24_576], a[24_576:]]))[0, 1]) < 0.03


def test_draws_by_the_noise_follow_softmax_and_a_wrong_temperature_fails():
    """argmax(logits + gumbel_offsets) over 6,000 draws from one generator: chi-square against softmax(logits / T);
    the counts reject softmax at another temperature."""
    from scipy.stats import chisquare

    logits = torch.tensor([2.0, 0.5, -1.0, 1.5, 0.0, 3.0, -0.5])
    g = torch.Generator().manual_seed(1)
    for t in (1.0, 0.6):
        cnt = torch.zeros(logits.numel())
        for _ in range(6000):
            cnt[int((logits + gumbel_offsets(logits.numel(), g, t)).argmax())] += 1
        want = torch.softmax(logits.double() / t, 0) * 6000
        assert chisquare(cnt.tolist(), want.tolist()).pvalue > 1e-3
        wrong = torch.softmax(logits.double() / (t * 1.25), 0) * 6000
        assert chisquare(cnt.tolist(), wrong.tolist()).pvalue < 1e-6


def test_gumbel_offsets_on_the_cpu_are_the_kernels_noise_from_one_draw_of_the_generator():
    """Where the kernels load with vector instructions, an offset vector is ``hsd_gumbel`` keyed by one int64 of the
    generator, and the generator moves by that one draw (what comes next from it is unchanged by the vocabulary)."""
    if not LIB.hsd_simd():
        pytest.skip("the portable build: gumbel_offsets takes torch's noise")
    g, ref = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    got = gumbel_offsets(50_000, g, 0.8)
    key = int(torch.randint(-2 ** 63, 2 ** 63 - 1, (), generator=ref)) & MASK
    assert torch.equal(got, kernels.gumbel(LIB, key, 50_000, 0.8))
    assert torch.equal(torch.rand(5, generator=g), torch.rand(5, generator=ref))
    assert gumbel_offsets(3, torch.Generator().manual_seed(7), 0.8).shape == (3,)


def test_every_build_computes_the_same_noise(tmp_path, monkeypatch):
    """The portable build (no vector instructions, software FMA) gives this machine's variant's bits."""
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    portable = kernels.load(variant="portable")
    if portable is None:
        pytest.skip("the portable variant does not build here")
    for key, n in ((3, 4097), (MASK - 5, 1000)):
        a, b = torch.empty(n), torch.empty(n)
        portable.hsd_gumbel(key, n, 1.1, a.data_ptr(), 1)
        LIB.hsd_gumbel(key, n, 1.1, b.data_ptr(), 2)
        assert torch.equal(a, b)


def test_hsd_doctor_says_where_the_noise_comes_from(tmp_path, monkeypatch):
    """The kernels' noise where the library has vector instructions, torch's with the portable build or none."""
    from hsd_opt.commands.doctor import sampling_line

    if LIB.hsd_simd():
        assert "kernels make each draw's noise" in sampling_line(LIB)
    else:
        assert "torch's noise (torch.rand)" in sampling_line(LIB)
    assert "no kernels" in sampling_line(None)
    monkeypatch.setenv("HSD_CACHE", str(tmp_path))
    portable = kernels.load(variant="portable")
    if portable is not None:
        assert "torch's noise (torch.rand)" in sampling_line(portable)
