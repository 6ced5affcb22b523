"""The block manager: KVCacheManager and the modules it orchestrates, on one CacheState.

Admission plan and execution, commit, lifecycle, allocator, the prefix tree, slot pools,
layer-group kinds, the events emitter, stats, and the manager-side halves of the persistent and
remote tiers. It imports the tier libraries, hashing, eviction, events and config; nothing below
it imports it, and neither does the router.
"""
