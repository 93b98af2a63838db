machine grow
entry write
budget 3
state write {
  structure "a line"
  prompt "write"
  output lines
  when "finished" -> END
  otherwise -> write
}
