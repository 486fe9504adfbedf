// depthtools report: sortable tables (click a header) and "Download CSV" buttons. No dependencies.
(function () {
  "use strict";
  function cellValue(td) { var v = td.getAttribute("data-v"); return v === null ? td.textContent : v; }
  function asNumber(text) { return text === "" ? NaN : Number(text); }

  function sortBy(table, index, th) {
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var numeric = th.getAttribute("data-type") === "num";
    var dir = th.getAttribute("aria-sort") === "ascending" ? -1 : 1;
    rows.sort(function (a, b) {
      var x = cellValue(a.cells[index]), y = cellValue(b.cells[index]);
      if (numeric) {
        var nx = asNumber(x), ny = asNumber(y);
        if (isNaN(nx) && isNaN(ny)) return 0;
        if (isNaN(nx)) return 1;   // missing values last in both directions
        if (isNaN(ny)) return -1;
        return (nx - ny) * dir;
      }
      return x.localeCompare(y, undefined, { numeric: true }) * dir;
    });
    rows.forEach(function (r) { body.appendChild(r); });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", dir === 1 ? "ascending" : "descending");
  }

  function csvField(text) {
    // Neutralise spreadsheet formulas in text cells; numbers (e.g. -0.5) stay as they are.
    if (/^[=+\-@\t\r]/.test(text) && isNaN(Number(text))) text = "'" + text;
    return /[",\r\n]/.test(text) ? '"' + text.replace(/"/g, '""') + '"' : text;
  }

  function tableCSV(table) {
    var head = Array.prototype.map.call(table.tHead.rows[0].cells, function (th) {
      return csvField(th.getAttribute("data-col") || th.textContent);
    });
    var lines = [head.join(",")];
    Array.prototype.forEach.call(table.tBodies[0].rows, function (row) {
      lines.push(Array.prototype.map.call(row.cells, function (td) { return csvField(cellValue(td)); }).join(","));
    });
    return lines.join("\r\n") + "\r\n";
  }

  function download(filename, text) {
    var url = URL.createObjectURL(new Blob([text], { type: "text/csv;charset=utf-8" }));
    var a = document.createElement("a");
    a.href = url;
    a.download = filename;
    document.body.appendChild(a);
    a.click();
    setTimeout(function () { URL.revokeObjectURL(url); a.remove(); }, 10000);
  }

  function init() {
    Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
      Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, index) {
        th.addEventListener("click", function () { sortBy(table, index, th); });
        th.addEventListener("keydown", function (e) {
          if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sortBy(table, index, th); }
        });
      });
    });
    Array.prototype.forEach.call(document.querySelectorAll("button.csv-button"), function (button) {
      button.addEventListener("click", function () {
        var table = document.getElementById(button.getAttribute("data-table"));
        if (table) download(button.getAttribute("data-filename") || "table.csv", tableCSV(table));
      });
    });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init); else init();
})();
