// Live updates of the console's pages: the server tells which runs changed (server-sent events)
// and the page fetches its own server-rendered part again. No inline script: the CSP forbids it.
"use strict";

(function () {
  const live = document.querySelector("[data-live]");
  if (!live || !window.EventSource) {
    return;
  }
  const follows = live.dataset.follow;
  let fetching = false;
  let again = false;

  function typing() {
    // A reply being written, or runs being picked, is never replaced under the writer's hands.
    const fields = Array.from(live.querySelectorAll("textarea, input[type=text], input[type=checkbox]"));
    return fields.some((field) =>
      field.type === "checkbox" ? field.checked : field.value !== "" || field === document.activeElement
    );
  }

  // "Select all" of a question's cards ticks every card of its bulk form.
  live.addEventListener("change", (event) => {
    const all = event.target;
    if (!all.classList || !all.classList.contains("select-all")) {
      return;
    }
    live.querySelectorAll(`input[name=pick][form="${all.dataset.form}"]`).forEach((pick) => {
      pick.checked = all.checked;
    });
  });

  async function refresh() {
    if (fetching) {
      again = true;
      return;
    }
    if (typing()) {
      return;
    }
    fetching = true;
    try {
      const response = await fetch(live.dataset.live, { credentials: "same-origin" });
      const html = response.ok ? await response.text() : null;
      // Asked again once the answer is here: a field filled, or a run picked, while it was on its
      // way (the page's first refresh races the operator's first click) is kept, not replaced.
      if (html !== null && !typing()) {
        live.innerHTML = html;
      }
    } finally {
      fetching = false;
      if (again) {
        again = false;
        refresh();
      }
    }
  }

  const source = new EventSource("/events");
  // What changed between the page's rendering and the stream's (re)opening is caught up at once.
  source.addEventListener("open", refresh);
  source.addEventListener("runs", (event) => {
    const change = JSON.parse(event.data);
    if (follows === "*" || change.everything || change.runs.includes(follows)) {
      refresh();
    }
  });
})();

// The answers a running run's model is writing, streamed while this page is open (ADR 0070):
// shown as text, each call's answer so far, and hidden again once its calls end.
(function () {
  const answering = document.querySelector("[data-answers]");
  if (!answering || !window.EventSource) {
    return;
  }
  const list = answering.querySelector(".answers");
  const source = new EventSource(answering.dataset.answers);
  source.addEventListener("answers", (event) => {
    const calls = JSON.parse(event.data).calls;
    list.replaceChildren(
      ...calls.map((call) => {
        const answer = document.createElement("pre");
        answer.className = "answer";
        answer.dataset.call = call.key;
        answer.textContent = call.text;
        return answer;
      })
    );
    answering.hidden = calls.length === 0;
  });
})();
