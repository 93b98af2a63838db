# expect: no-catch-all, undeclared-tool, unreachable-state, unwritten-context-key
machine m
entry a
budget 10

state a {
  tool lookup { q: "{{question}}" }
  output o
  when "found" -> END
}

state orphan {
  structure "s"
  prompt "p"
  output p
  otherwise -> END
}
