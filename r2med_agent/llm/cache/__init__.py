"""The generation cache, apart from the backends: the SQLite file (store) and what it stores
(records), leases between runs sharing it (leases, sharing), the wrapper every backend runs
behind (wrapper: CachedLLM; keys: key building; dispatch: backend calls and the write queue),
moving generations between the cache and R2MED's published files (transfer), and a damaged file
named and repaired (damage, repair)."""
