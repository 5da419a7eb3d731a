"""Mixtures of experts: the layer and its experts (`layer`), the router and its statistics
(`router`), the statistics turned into losses and metrics (`stats`, `metrics`), expert capacity
(`capacity`), DeepSeek-V3's bias balancing (`balance`) and the global-batch counts of
moe.aux_scope=global_batch (`global_router`). Import the modules directly."""
