"""Online RL from verifiable rewards (GRPO and its fixes), as TRL 1.x's GRPOTrainer defines it.

    rl/advantages.py  group-relative advantages from the reward functions' scores
    rl/losses.py      the clipped policy loss, the KL term and the metrics, normalised over
                      the whole global batch so that every layout gives the single process's loss
    rl/iterations.py  rl.num_iterations: a generation trained on mu times, its old log-probs kept
"""
