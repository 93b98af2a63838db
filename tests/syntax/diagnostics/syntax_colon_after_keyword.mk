# expect: syntax
machine m
entry: a
budget 10
