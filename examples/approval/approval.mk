# approval.mk: draft a status-page announcement, park it on a reviewer's
# decision, then publish it, revise it or drop it, as the reviewer chooses.
#
# The decision is typed: the reviewer answers approve, revise or reject
# (`mklang resume --answer approve`), so the human's choice is the
# transition and no judge reads free text on the way to `publish`. The answer
# is bound to the announcement it was shown (`show`): a changed draft cannot
# slip under an approval. A question nobody answers within 48 hours is
# dropped (`mklang runs sweep` applies deadlines). Reads `topic` and
# `audience`; writes `announcement`, `approval` (the reviewer's choice and
# note) and `published` (the result: the URL of the post).
mklang 0.5
machine approval
entry draft
budget 12
result published

context {
  topic: "Scheduled maintenance on Saturday from 02:00 to 04:00 UTC; logins may fail."
  audience: "all customers"
}

tool publish "Post an announcement to the status page. Input: {text}. Returns the URL of the post."

state draft {
  structure "An announcement: a title line, then at most 80 words."
  prompt """
    Write a status-page announcement for {{audience}} about: {{topic}}
    The reviewer's notes on the previous version, if any: {{approval.note}}
    """
  output announcement
  max_visits 3
  otherwise escalate ask "Publish this announcement?" show announcement reply_to approval {
    choice "approve" -> publish
    choice "revise" -> draft
    choice "reject" fail
    within 48h fail
  }
}

state publish {
  tool publish { text: "{{announcement}}" }
  output published
  otherwise -> END
}
