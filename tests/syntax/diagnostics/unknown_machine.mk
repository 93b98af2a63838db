# expect: unknown-machine
machine m
entry a
budget 10

state a {
  call summarize_doc { text: "hello" }
  output o
  otherwise -> END
}
