"""A GRPO rollout phase (megaft.rl.online with megaft.training.objectives.grpo.rollout_generator): a
rank's prompts of the step go to the generator in one call, ZeRO-3's layers are gathered once for
all of them (not once a prompt), and prompt j's completions are still the draws seeded by
draw_seed(step, j) alone: the tokens are a pure function of the seed, the step and the position."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

from megaft.config.model import ModelConfig
from megaft.config.rl import RLConfig
from megaft.inference.generate import Sampling, generate
from megaft.models.decoder import Decoder
from megaft.models.init import init_params
from megaft.parallel.grid import ParallelGrid
from megaft.rl.online import OnlineRollouts, Prompt, draw_seed
from megaft.training.objectives.grpo import rollout_generator

G, EOS = 3, 1


class CountingOptim:
    """whole_params as ZeRO-3's: counts how often the layers would be gathered."""

    def __init__(self):
        self.gathers = 0

    @contextlib.contextmanager
    def whole_params(self):
        self.gathers += 1
        yield


def test_one_gather_a_rollout_phase_and_the_seeded_draws():
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=37, max_seq_len=32)
    model = Decoder(cfg)
    init_params(model, cfg, seed=0, tp_rank=0, tp_size=1)
    grid = ParallelGrid.single()
    rl = RLConfig(num_generations=G, temperature=0.9, top_p=0.95, max_completion_length=6)
    run_cfg = SimpleNamespace(rl=rl, train=SimpleNamespace(seed=7), model=SimpleNamespace(extra={}))
    optim = CountingOptim()
    parts = SimpleNamespace(cfg=run_cfg, grid=grid, optim=optim, data=SimpleNamespace(eos_id=EOS))
    step = SimpleNamespace(generator=model, autocast=contextlib.nullcontext)
    prompts = [Prompt([5, 6, 7], {}), Prompt([8, 9], {}), Prompt([10, 11, 12, 13], {})]
    online = OnlineRollouts(prompts, num_generations=G, max_completion_length=6, seq_len=12, grid=grid)
    calls = []
    gen = rollout_generator(parts, step)
    online.generate = lambda asked, s: calls.append(sorted(asked)) or gen(asked, s)
    groups = online.groups(2, 3)
    assert calls == [[0, 1, 2]] and optim.gathers == 1  # one call and one gather for the step's 3 prompts
    sampling = Sampling(temperature=0.9, top_p=0.95, seed=7)
    for j, grp in enumerate(groups):  # each prompt alone, seeded by its position: the same tokens
        want = generate(model, [prompts[(6 + j) % 3].ids] * G, max_new_tokens=min(6, 12 - len(grp.prompt_ids)),
                        eos_id=[EOS], device=grid.device, sampling=sampling, step=draw_seed(2, j), keep_eos=True)
        assert grp.prompt_ids == prompts[(6 + j) % 3].ids and grp.completion_ids == want
    assert len({tuple(c) for grp in groups for c in grp.completion_ids}) > 1  # sampled, not one repeated row
