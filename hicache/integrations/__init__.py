"""hicache as another engine's KV cache: `sglang` (`HiCacheStore`, an SGLang `HiCacheStorage`
backend over hicache's L3 stores).

Each module here imports the engine it plugs into, and only it; nothing imports them but the
engine (SGLang loads `hicache.integrations.sglang` by name), so `import hicache` never
imports an engine. The modules beside them (`sglang_settings`, `sglang_pages`) import none.
"""
