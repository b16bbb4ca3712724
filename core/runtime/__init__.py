"""The runtime: paged KV pool, block manager, scheduler, model runner."""
