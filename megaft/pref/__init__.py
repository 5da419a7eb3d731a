"""Preference tuning, with TRL as the specification: the pairs and the token ids TRL's
DPOTrainer makes of them (megaft.pref.data), the per-sequence log-probabilities of the
completions from the vocab-parallel cross-entropy (megaft.pref.logps), and the objectives
with TRL's metric names (megaft.pref.losses: DPO with its conservative and robust forms,
IPO, SimPO, ORPO). Import the submodules."""
