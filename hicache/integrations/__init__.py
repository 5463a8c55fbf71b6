"""hicache as another engine's KV cache: `sglang` (`HiCacheStore`, an SGLang `HiCacheStorage`
backend over hicache's L3 stores) and `vllm` (`HiCacheConnector`, a vLLM v1 KV connector over
hicache's L2 and L3).

Each module here imports the engine it plugs into, and only it; nothing imports them but the
engine (each loads its module by name), so `import hicache` never imports an engine. The
modules beside them (`*_settings`, `sglang_pages`, `vllm_scheduler`, `vllm_worker`,
`store_sections`) import none, and are tested without the engine.
"""
