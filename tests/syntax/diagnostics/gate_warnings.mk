# expect: dead-gate, max-visits-under-repair, repair-only-otherwise, undeclared-hook
machine m
entry a
budget 10

state a {
  structure "s"
  prompt "p"
  output o
  max_visits 2
  when "short" hook is_short -> END
  otherwise repair 2 -> a
  when "never" -> END
}
