"""Parameter-efficient fine-tuning: LoRA adapters on the tensor-parallel linears
(megaft.peft.lora) and on a mixture of experts' experts and router (megaft.peft.experts,
exported by megaft.peft.moe_export), their settings (megaft.config.lora), the base checkpoint's
fingerprint that adapter-only checkpoints record (megaft.peft.base) and the export
in peft's adapter format or as merged weights (megaft.peft.export)."""
