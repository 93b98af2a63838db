# expect: syntax
machine m
entry a
budget 10

context {
  notes: [1, 2
}
