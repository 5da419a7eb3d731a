"""Vision-language models: Gemma 3's SigLIP tower and projector around a megaft Decoder
(docs/vision.md)."""
