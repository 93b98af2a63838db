# long.mk: pages long enough that the finished run's trace passes 64 KB: its last snapshot
# seals it into a trace segment (ADR 0040), for the kill -9 tests at the `segment` crash point.
mklang 0.4
machine long
entry one
budget 10

state one {
  structure "A long page."
  prompt "Write a long page, page one"
  output one
  otherwise -> two
}

state two {
  structure "A long page."
  prompt "Write a long page, page two"
  output two
  otherwise -> three
}

state three {
  structure "A long page."
  prompt "Write a long page, page three"
  output three
  otherwise -> four
}

state four {
  structure "A long page."
  prompt "Write a long page, page four"
  output four
  otherwise -> five
}

state five {
  structure "A long page."
  prompt "Write a long page, page five"
  output five
  otherwise -> six
}

state six {
  structure "A long page."
  prompt "Write a long page, page six"
  output six
  otherwise -> END
}
