"""Sampling: `SamplingParams` (parsing and validation) and the batched `Sampler`.

The implementation lives in `engine.sampling_params` and `engine.sampler`; import from here.
"""

from engine.sampler import Sampler
from engine.sampling_params import GREEDY_EPS, MAX_N, SamplingParams

__all__ = ["GREEDY_EPS", "MAX_N", "Sampler", "SamplingParams"]
