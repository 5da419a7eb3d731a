"""The optimizer: AdamW over flat buffers (fp32, or bf16 with fp32 master weights), ZeRO 1-3
(`zero`, `zero3`: its state sharded over the dp×cp replicas, Megatron's distributed optimizer),
host offload, fp16 loss scaling, LR schedule, exact clipping. Import the modules directly."""
