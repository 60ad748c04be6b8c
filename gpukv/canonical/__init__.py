"""The canonical order of sums: one fixed binary tree over a key's values, so a
deterministic store gives the same bits whatever the strategy, the layout of its values
over devices and processes, or the home.

- `tree`: the order itself (which pairs are added, for any split of the leaves) and the
  plan of adds that merges a layout's node partials into the root;
- `arrays`: that plan run on NumPy arrays, shared by the host tree sum
  (`device.host_sum.host_tree_sum`) and the merges across processes (`merge_into`).

Its users each follow the tree, never an order of their own: the GPU sum is a kernel
(`device.cuda.kernels.tree_sum_source`: a binary counter over the leaves, the same pairs
as `tree`, checked bit for bit against it); one process's deterministic strategy is
`comm.canonical.Canonical`; a worker's node partials come from `distributed.parts.node_sums`;
the engines merge them with `arrays.merge_into`.
"""
