"""Memory of the engine (pure Python): pages and slots (`cache_manager`), the radix prefix cache
with its state checkpoints and host tier, eviction policies and the cache's configuration."""
