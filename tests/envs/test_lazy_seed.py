"""A seeded reset builds the env's generator when it is first used: the same draws as
gymnasium's own ``reset(seed=...)``, the same seed, the same refusal of a bad seed."""

from __future__ import annotations

import pytest
from gymnasium.utils import seeding

from palaestra.envs import make
from palaestra.envs.calculator import CalculatorEnv


def test_lazy_generator_draws_what_gymnasium_seeds() -> None:
    env = CalculatorEnv()
    row = {"question": "What is 1 + 1?", "answer": "2"}
    env.reset(seed=7, options={"task": row})  # a task row: nothing drawn yet
    assert env._np_random is None and env.np_random_seed == 7
    expected, _ = seeding.np_random(7)
    assert env.np_random.integers(1 << 30, size=4).tolist() == \
        expected.integers(1 << 30, size=4).tolist()
    assert env.np_random_seed == 7
    # without a task the draw happens at reset, from the same seeded stream
    a, b = make("palaestra/Calculator-v0"), CalculatorEnv()
    assert a.reset(seed=11)[0] == b.reset(seed=11)[0]
    generator, _ = seeding.np_random(3)
    env.np_random = generator  # gymnasium's setter: an unknown seed
    assert env.np_random is generator and env.np_random_seed == -1
    with pytest.raises(Exception, match="greater or equal to zero"):
        env.reset(seed=-1)
