"""Derived seeds stay what they were: another stride would change every sampled benchmark, profile, head training
and ADED search made with a given seed."""

from hsd_opt.measure.bench import Sampling
from hsd_opt.seeds import SEED_STRIDE


def test_the_stride_derives_the_seeds_it_always_did():
    assert SEED_STRIDE == 1_000_003
    assert Sampling(temperature=1.0, seed=7).seed_for(3, 0) == 10
    assert Sampling(temperature=1.0, seed=7).seed_for(3, 2) == 7 + 3 + 2 * 1_000_003
