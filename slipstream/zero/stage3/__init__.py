"""ZeRO stage 3: parameters sharded across the data-parallel ranks, gathered per unit when used.

[Note: ZeRO-3 vocabulary]
- *unit*: a block of modules whose parameters are gathered and freed together with one collective
  (a transformer layer, as in FSDP2). `units.py` chooses them; the root module's leftovers form one
  more unit, and parameters below `stage3_param_persistence_threshold` elements form the *persistent*
  unit, which stays gathered on every rank.
- *shard*: a rank's slice of a unit. Each parameter contributes `ceil(numel / world)` elements (padded
  at its end, as DeepSpeed does); the shard is the concatenation of those slices, in the model dtype.
- *full buffer*: the unit's gathered parameters, one flat tensor laid out parameter by parameter (each
  padded to `world * ceil(numel / world)`). Every parameter's `.data` is a view into it for good; freeing
  the unit resizes the buffer's storage to zero bytes and gathering fills it again, so views saved by
  autograd in forward see the right values again in backward.
- *gather buffer*: the rank-major receive buffer of the all-gather (pooled, reused across units).
The modules: `units.py` (which modules are units, pure), `sharded_param.py` (the parameter type that
keeps global shape and refuses data access while sharded), `unit.py` (one unit's buffers and its two
collectives), `fp8_gather.py` (float8 layers' weights gathered in float8), `coordinator.py` (hooks: when to
gather, prefetch, free and reduce), `model.py` (turns a module into units), `optimizer.py` (the step on the
shards).
"""
