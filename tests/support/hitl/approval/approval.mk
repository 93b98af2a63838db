# approval.mk: draft a status-page announcement, park it for a human's
# approval, then publish it or revise it as the reviewer says.
#
# Run with --checkpoint and --hitl to suspend at the approval question;
# `mklang resume --set approval.answer=...` delivers the reviewer's answer.
# Reads `topic`, `audience` and `approval.answer`; writes `announcement`,
# `verdict` and `published` (the result: the URL of the post).
mklang 0.4
machine approval
entry draft
budget 12
result published

context {
  topic: "Scheduled maintenance on Saturday from 02:00 to 04:00 UTC; logins may fail."
  audience: "all customers"
  approval: { answer: "" }
}

tool publish "Post an announcement to the status page. Input: {text}. Returns the URL of the post."

state draft {
  structure "An announcement: a title line, then at most 80 words."
  prompt """
    Write a status-page announcement for {{audience}} about: {{topic}}
    Reviewer's notes on the previous version, if any: {{approval.answer}}
    """
  output announcement
  max_visits 3
  otherwise escalate -> decide ask "Publish this announcement? Answer yes, or say what to change." reply_to approval.answer
}

# `mklang check` warns that a judge chooses `publish` here (untrusted-control-flow):
# it reads the reviewer's free-text answer, which is outside data, so its choice
# is tainted and the run's trace marks the publish step. To have code confirm the
# approval, give the approving gate a hook; `--untrusted-flow halt` refuses it.
state decide {
  tier fast
  structure "One word: approve, revise or reject."
  prompt "The reviewer answered: {{approval.answer}}. What do they want done with the announcement?"
  output verdict
  when "the reviewer approves publishing it as is" -> publish
  when "the reviewer asks for changes" -> draft
  when "the reviewer rejects the announcement" fail
  otherwise fail
}

state publish {
  tool publish { text: "{{announcement}}" }
  output published
  otherwise -> END
}
