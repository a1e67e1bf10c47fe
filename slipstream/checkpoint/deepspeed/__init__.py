"""DeepSpeed-format checkpoints: reading, writing and converting the folders DeepSpeed 0.19 saves.

Nothing here is Slipstream's own format (that is the parent folder: manifest, safetensors, atomic commit).
`constants` (the format's key and file names), `layout` (which rank's file is which, at the saved degrees or
smaller ones), `folder` (a tag folder's metadata without its tensors), `safe_pickle` (the restricted unpickler
every `.pt` goes through), `reader` (a whole checkpoint as global tensors, ZeRO stages 0 to 3), `universal`
(DeepSpeed's universal layout, read and written), and the converter of tensor-parallel folders to it:
`zero12_grid` / `zero3_grid` (each tensor rank's shards), `tp_merge` / `subparam` (the merge rules, fused
sub-parameters), `tp_shards` (the merged files written), `tp_universal` (the whole conversion).
"""
