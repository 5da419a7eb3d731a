"""Reward models (train.objective=reward): the sequence reward at the last real token, TRL's
RewardTrainer loss, and the pairs' optional margins."""
