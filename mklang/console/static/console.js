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
    // A reply being written is never replaced under the writer's hands.
    if (!("keepTyping" in live.dataset)) {
      return false;
    }
    return Array.from(live.querySelectorAll("textarea")).some(
      (area) => area.value !== "" || area === document.activeElement
    );
  }

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
      if (response.ok) {
        live.innerHTML = await response.text();
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
