# word_problem.mk: solve an arithmetic word problem by self-consistency.
#
# Five independent attempts run side by side; if they scatter, the whole
# batch is re-sampled once. A vote keeps the majority answer with the
# arithmetic behind it, and the calculator tool confirms it. Reads
# `problem`; writes `attempts`, `final` (the result) and `checked`.
mklang 0.4
machine word_problem
entry solve
budget 16
result final

context {
  problem: "A crate holds 6 boxes of 7 apples. How many apples are in the crate?"
}

tool calc read_only "Evaluate an arithmetic expression. Input: {expression}. Returns the number."

state solve {
  sample 5
  structure "A JSON object with the keys answer (a number) and work (one line of arithmetic)."
  prompt """
    Attempt {{index}}: solve this problem on your own, showing the arithmetic.
    {{problem}}
    """
  parse json
  output attempts
  when "fewer than three attempts share one answer" repair 1 -> solve
  otherwise -> vote
}

state vote {
  tier fast
  structure "A JSON object with the keys answer (a number) and expression (the arithmetic that yields it)."
  prompt """
    Independent attempts at this problem: {{problem}}
    {{attempts}}
    Keep the answer most attempts reached.
    """
  parse json
  output final
  otherwise -> verify
}

state verify {
  tool calc { expression: "{{final.expression}}" }
  output checked
  when "the calculation equals the chosen answer" -> END
  otherwise fail
}
