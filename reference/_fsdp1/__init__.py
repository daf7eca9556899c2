"""The FSDP1 part: flat-parameter sharding behind :class:`FullyShardedDataParallel`.

Modules, each importing only the ones before it (and :mod:`reference.api`):

* ``_common_utils``: the wrapper's base class ``_FSDPState`` and name helpers, so that no helper
  imports the wrapper;
* ``_flat_layout``: the pure arithmetic of a flat parameter (offsets, padding, shard ranges);
* ``_flat_param``: :class:`FlatParameter` and the handle that flattens, shards and unshards it;
* ``_init_utils``, ``_runtime_utils``, ``_load_checks``, ``_state_dict_utils``: construction,
  forward/backward hooks, load-input validation and the state-dict hooks;
* ``fully_sharded_data_parallel``: the wrapper class that ties them together.
"""
