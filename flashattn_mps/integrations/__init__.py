"""Integrations with model libraries, each importing its library only when imported itself:
`flashattn_mps.integrations.transformers` (Hugging Face transformers' attention interface) and
`flashattn_mps.integrations.diffusers` (a diffusers attention processor)."""
