# map_reduce: apply one instruction to every item of a list, then combine
# the results. `map` runs `instruction` on each item of `items`
# concurrently into `mapped` (a fan-out costs one step per item, so the
# budget admits up to 28 items); `reduce` combines them as `goal` says into
# `reduced` (the result) and fails when an item could not be processed.
# Reads `items`, `instruction` and `goal`; writes `mapped` and `reduced`.
mklang 0.4
machine map_reduce
entry map
budget 30
result reduced

context {
  items: []
  instruction: "Summarize this item in one sentence."
  goal: "Combine the results into one short paragraph."
}

state map {
  over items
  structure "The result for this one item only."
  prompt """
    {{instruction}}
    Item {{index}}:
    {{item}}
    """
  output mapped
  otherwise -> reduce
}

state reduce {
  structure "The combined result only."
  prompt """
    {{goal}}
    Results, one per item:
    {{mapped}}
    """
  output reduced
  when "a result is a branch-error marker" fail
  otherwise -> END
}
