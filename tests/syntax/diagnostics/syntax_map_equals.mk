# expect: syntax
machine m
entry a
budget 10

context {
  ticket = "x"
}
