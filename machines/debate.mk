# debate: two debaters argue opposite sides of a question for up to three
# rounds, then a moderator rules. Each round runs both seats side by side
# (`sample 2`: seat 0 argues for, seat 1 against) and appends their pair
# of arguments to `transcript`; the moderator asks for another round or
# writes the ruling. A fourth round halts with loop-ceiling. Reads
# `question`; writes `transcript` and `ruling` (the result).
mklang 0.4
machine debate
entry argue
budget 12
result ruling

context {
  question: ""
  transcript: []
}

state argue {
  sample 2
  structure "Your single strongest new argument, at most 60 words."
  prompt """
    Debate question: {{question}}
    Seat 0 argues for the proposition, seat 1 against it. Your seat: {{index}}.
    Arguments so far, one pair (for, against) per round:
    {{transcript}}
    """
  accumulate
  output transcript
  max_visits 3
  otherwise -> moderate
}

state moderate {
  tier reasoning
  reason
  structure "Either the single word CONTINUE, or a ruling: the better-supported answer and why, in at most 80 words."
  prompt """
    Moderate this debate on: {{question}}
    Arguments so far, one pair (for, against) per round:
    {{transcript}}
    """
  output ruling
  when "the moderator asks for another round" -> argue
  otherwise -> END
}
