// Sorting and filtering for the report's tables; no network, no libraries.
(function () {
  "use strict";

  function cellValue(row, index) {
    var cell = row.cells[index];
    if (!cell) return "";
    var v = cell.getAttribute("data-value");
    return v !== null ? v : cell.textContent.trim();
  }

  function compareValues(a, b) {
    var x = parseFloat(a), y = parseFloat(b);
    if (!isNaN(x) && !isNaN(y) && String(x) === a.trim() && String(y) === b.trim()) return x - y;
    return a.localeCompare(b, undefined, {numeric: true});
  }

  function makeSortable(table) {
    var headers = table.tHead ? table.tHead.rows[0].cells : [];
    Array.prototype.forEach.call(headers, function (th, index) {
      if (th.hasAttribute("data-nosort")) return;
      th.classList.add("sortable");
      th.addEventListener("click", function () {
        var asc = th.getAttribute("data-order") !== "asc";
        Array.prototype.forEach.call(headers, function (h) { h.removeAttribute("data-order"); });
        th.setAttribute("data-order", asc ? "asc" : "desc");
        var body = table.tBodies[0];
        // a row's detail row (class cell-detail, right after it) travels with it
        var rows = Array.prototype.filter.call(body.rows, function (r) {
          return !r.classList.contains("cell-detail");
        });
        var details = rows.map(function (r) {
          var next = r.nextElementSibling;
          return next && next.classList.contains("cell-detail") ? next : null;
        });
        var order = rows.map(function (r, i) { return i; });
        order.sort(function (i, j) {
          var d = compareValues(cellValue(rows[i], index), cellValue(rows[j], index));
          return asc ? d : -d;
        });
        order.forEach(function (i) {
          body.appendChild(rows[i]);
          if (details[i]) body.appendChild(details[i]);
        });
      });
    });
  }

  function setupParityFilters() {
    var table = document.getElementById("parity-table");
    if (!table) return;
    var selects = document.querySelectorAll("select[data-filter]");
    var chips = document.querySelectorAll("button[data-status-filter]");
    var search = document.getElementById("parity-search");
    var count = document.getElementById("parity-count");
    var status = "";

    function apply() {
      var text = search ? search.value.toLowerCase() : "";
      var shown = 0;
      var rows = table.tBodies[0].querySelectorAll(":scope > tr.cell-row");
      Array.prototype.forEach.call(rows, function (row) {
        var ok = true;
        Array.prototype.forEach.call(selects, function (s) {
          if (s.value && row.getAttribute("data-" + s.getAttribute("data-filter")) !== s.value) ok = false;
        });
        if (status && row.getAttribute("data-status") !== status) ok = false;
        if (text && row.textContent.toLowerCase().indexOf(text) < 0) ok = false;
        row.hidden = !ok;
        var detail = row.nextElementSibling;
        if (detail && detail.classList.contains("cell-detail")) {
          detail.hidden = !ok || !row.classList.contains("open");
        }
        if (ok) shown += 1;
      });
      if (count) count.textContent = shown + " of " + rows.length + " cells shown";
    }

    Array.prototype.forEach.call(selects, function (s) { s.addEventListener("change", apply); });
    Array.prototype.forEach.call(chips, function (chip) {
      chip.addEventListener("click", function () {
        status = chip.getAttribute("data-status-filter");
        Array.prototype.forEach.call(chips, function (c) { c.classList.toggle("active", c === chip); });
        apply();
      });
    });
    if (search) search.addEventListener("input", apply);
    // a click on a cell's row opens its metrics, tolerance and reason (and closes them again)
    Array.prototype.forEach.call(table.tBodies[0].querySelectorAll(":scope > tr.cell-row"), function (row) {
      row.addEventListener("click", function () {
        var detail = row.nextElementSibling;
        if (!detail || !detail.classList.contains("cell-detail")) return;
        row.classList.toggle("open");
        detail.hidden = !row.classList.contains("open");
      });
    });
    apply();
  }

  document.addEventListener("DOMContentLoaded", function () {
    Array.prototype.forEach.call(document.querySelectorAll("table.sortable-table"), makeSortable);
    setupParityFilters();
  });
})();
