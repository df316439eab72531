//! `sim run --report` and `sim replay --report` through the real binary: the page has every
//! series (an `<svg id="series-…">` with its title and something drawn) and its marks, is
//! written 0644 with no temporary file left, and written over an old one; the run's digest is
//! the same with and without it; a failed run's page marks the failure; and the page renders:
//! headless Chromium (Debian's `chromium`, `make system-deps`) takes a screenshot, decoded here,
//! that shows the series' own colours. Never skipped: without Chromium the test fails and says
//! how to get it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bc_core::id::TenantId;
use bc_tests::{Server, cli, json, log_key_pin};
use serde_json::json;

/// The series every page has, by id (`bc_simulator::report::SERIES`), and their titles.
const SERIES: &[(&str, &str)] = bc_simulator::report::SERIES;
/// The screenshot's window, as a person's laptop would show the page.
const WINDOW: (u32, u32) = (1200, 900);
/// How long Chromium may take to take its screenshot.
const CHROMIUM_TIMEOUT_S: u64 = 90;
/// A screenshot is blank below this share of non-background pixels.
const INK_SHARE_MIN: f64 = 0.02;
/// Pixels near a series' colour that show its line or area was drawn.
const SERIES_PIXELS_MIN: usize = 200;
/// The GPU utilization (blue) and queue depth (orange) panels' colours, the top two panels.
const GPU_BLUE: [u8; 3] = [0x1f, 0x77, 0xb4];
const QUEUE_ORANGE: [u8; 3] = [0xff, 0x7f, 0x0e];
/// The unsafe switch is caught within this many seeds (as in `sim_run.rs`).
const UNSAFE_SEEDS_MAX: u64 = 3;

fn sim_run(args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["sim", "run"];
    all.extend_from_slice(args);
    cli(&all, &[])
}

/// Every series' `<svg>`, with its title and a line, area or bar in it; and each of `marks` in
/// the legend and across every panel.
fn check_page(html: &str, marks: &[&str]) {
    assert!(html.starts_with("<!DOCTYPE html>"), "{}", &html[..html.len().min(200)]);
    assert!(!html.contains("<script"), "a report runs no script");
    assert_eq!(html.matches("http").count(), html.matches("http://www.w3.org/2000/svg").count(), "a report fetches nothing");
    for (id, title) in SERIES {
        let at = html.find(&format!("<svg id=\"{id}\"")).unwrap_or_else(|| panic!("no <svg id=\"{id}\"> in the report"));
        let svg = &html[at..at + html[at..].find("</svg>").expect("the svg closes")];
        assert!(svg.contains(&format!("<title>{title}</title>")), "{id} has no title");
        assert!(
            svg.contains("<polyline") || svg.contains("<polygon") || svg.contains("<rect"),
            "{id} draws no line, area or bar"
        );
        for mark in marks {
            assert!(svg.contains(&format!("class=\"mark {mark}\"")), "{id} lacks the {mark} line");
        }
    }
    for mark in marks {
        assert!(html.contains(&format!("<li id=\"{mark}\"")), "the legend lacks {mark}");
    }
}

/// The file is 0644, and its directory holds nothing but `keep` (no temporary file).
fn check_written(dir: &Path, path: &Path, keep: &[&str]) {
    let mode = std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o644, "{} is {mode:o}", path.display());
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    let mut keep: Vec<String> = keep.iter().map(|s| s.to_string()).collect();
    keep.sort();
    assert_eq!(names, keep, "only the files written, no temporary one");
}

/// Headless Chromium's screenshot of `page`, decoded: (width, height, RGB bytes).
fn screenshot(page: &Path) -> (u32, u32, Vec<u8>) {
    let found = Command::new("chromium").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    assert!(
        found.is_ok_and(|s| s.success()),
        "chromium is not installed: the report test opens the page in headless Chromium\nhint: run `make system-deps` (it installs Debian's chromium)"
    );
    let dir = tempfile::tempdir().unwrap();
    let png = dir.path().join("screenshot.png");
    let mut child = Command::new("chromium")
        .arg("--headless")
        .arg("--no-sandbox")
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("--window-size={},{}", WINDOW.0, WINDOW.1))
        // A profile of its own, so two tests' browsers never share one.
        .arg(format!("--user-data-dir={}", dir.path().join("profile").display()))
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("chromium starts");
    let deadline = Instant::now() + Duration::from_secs(CHROMIUM_TIMEOUT_S);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium took more than {CHROMIUM_TIMEOUT_S} s to take the screenshot of {}", page.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success() && png.exists(), "chromium took no screenshot ({status}):\n{err}");
    let bytes = std::fs::read(&png).unwrap();
    let mut decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    decoder.set_transformations(png::Transformations::normalize_to_color8());
    let mut reader = decoder.read_info().expect("a PNG");
    let mut buffer = vec![0; reader.output_buffer_size().expect("a size")];
    let info = reader.next_frame(&mut buffer).expect("the PNG decodes");
    let channels = info.color_type.samples();
    assert!(channels >= 3, "a colour screenshot: {:?}", info.color_type);
    let rgb: Vec<u8> = buffer[..info.buffer_size()].chunks(channels).flat_map(|p| [p[0], p[1], p[2]]).collect();
    (info.width, info.height, rgb)
}

/// The screenshot is not blank: enough pixels differ from the background (the most common
/// colour), and both top panels' series colours are there.
fn check_rendered(page: &Path) {
    let (width, height, rgb) = screenshot(page);
    assert_eq!((width, height), WINDOW);
    let pixels: Vec<[u8; 3]> = rgb.chunks(3).map(|p| [p[0], p[1], p[2]]).collect();
    let mut counts = std::collections::BTreeMap::new();
    for p in &pixels {
        *counts.entry(*p).or_insert(0usize) += 1;
    }
    let (background, _) = counts.iter().max_by_key(|(_, n)| **n).map(|(c, n)| (*c, *n)).unwrap();
    let ink = pixels.iter().filter(|p| **p != background).count();
    let share = ink as f64 / pixels.len() as f64;
    assert!(share >= INK_SHARE_MIN, "the screenshot of {} is blank: {:.4} of it is not {background:?}", page.display(), share);
    let near = |colour: [u8; 3]| {
        pixels.iter().filter(|p| p.iter().zip(colour).all(|(a, b)| (i16::from(*a) - i16::from(b)).abs() <= 24)).count()
    };
    for (name, colour) in [("GPU utilization's blue", GPU_BLUE), ("queue depth's orange", QUEUE_ORANGE)] {
        let n = near(colour);
        assert!(n >= SERIES_PIXELS_MIN, "the screenshot shows {n} pixels of {name} (at least {SERIES_PIXELS_MIN})");
    }
}

#[test]
fn a_run_report_has_every_series_renders_and_leaves_the_digest_alone() {
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("run.html");
    let page_arg = page.display().to_string();
    let args = ["--seed", "7", "--nodes", "10", "--tenants", "2", "--hours", "1", "--json"];
    let (status, out, err) = sim_run(&args);
    assert_eq!(status, 0, "{out}\n{err}");
    let plain = json(&out);
    // Over an old file of the name: a report is made again at will.
    std::fs::write(&page, "an old report").unwrap();
    let mut with_report = args.to_vec();
    with_report.extend(["--report", &page_arg]);
    let (status, out, err) = sim_run(&with_report);
    assert_eq!(status, 0, "{out}\n{err}");
    let reported = json(&out);
    assert_eq!(reported["report"], page_arg.as_str(), "{reported}");
    assert_eq!(reported["digest"], plain["digest"], "the same seed, the same digest, with or without --report");
    assert_eq!((&reported["heads"], &reported["steps"]), (&plain["heads"], &plain["steps"]));
    check_written(dir.path(), &page, &["run.html"]);
    let html = std::fs::read_to_string(&page).unwrap();
    check_page(&html, &["mark-liveness"]);
    assert!(html.contains(plain["digest"].as_str().unwrap()), "the page names the digest");
    assert!(html.contains("sim run ok: seed 7"), "the page says how the run ended");
    check_rendered(&page);
}

#[test]
fn a_failed_runs_report_marks_its_first_failure() {
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("failed.html");
    let page_arg = page.display().to_string();
    for seed in 1..=UNSAFE_SEEDS_MAX {
        let seed = seed.to_string();
        let mut args = bc_tests::small_sim_run(&seed);
        args.extend_from_slice(&["--unsafe-no-placement-guard", "--report", &page_arg]);
        let (status, out, err) = sim_run(&args);
        if status == 0 {
            continue;
        }
        assert_eq!(status, 1, "{out}\n{err}");
        assert!(err.contains("SIM_INVARIANT_BROKEN"), "{err}");
        let html = std::fs::read_to_string(&page).expect("a failed run still writes its report");
        check_page(&html, &["mark-failure"]);
        assert!(html.contains("sim run FAILED"), "the page says the run failed");
        assert!(html.contains("double booking"), "the failure says what broke");
        assert!(html.contains("--unsafe-no-placement-guard"), "the page has the command that repeats the run");
        check_written(dir.path(), &page, &["failed.html"]);
        return;
    }
    panic!("no failure within {UNSAFE_SEEDS_MAX} seeds with the unsafe switch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_report_has_every_series_marks_until_and_renders() {
    // A dev run's root tenant: a pool, two nodes of four GPUs, three reservations, one
    // released, one queued behind the others.
    let mut server = Server::dev();
    let pool = server.pool("report").await;
    server.h100_nodes(&pool, 2).await;
    let mut ids = Vec::new();
    for gpus in [4, 4, 2] {
        let (status, r) = server.call("reservations.create", json!({ "poolId": pool, "gpus": gpus, "durationS": 3600 })).await;
        assert_eq!(status, 200, "{r}");
        ids.push(r["reservationId"].as_str().unwrap().to_owned());
    }
    let (status, released) = server.call("reservations.release", json!({ "reservationId": ids[0] })).await;
    assert_eq!(status, 200, "{released}");
    server.stop();

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("root.bcx");
    let (data_dir, file_arg) = (server.data_dir.display().to_string(), file.display().to_string());
    let root = TenantId::ROOT.to_string();
    let (code, out, err) = cli(&["events", "export", "--tenant", &root, "--data-dir", &data_dir, "--out", &file_arg], &[]);
    assert_eq!(code, 0, "{err}");
    let events = json(&out)["events"].as_u64().unwrap();
    assert!(events >= 8, "{out}");
    let pin = log_key_pin(&server);
    let page = dir.path().join("replay.html");
    let page_arg = page.display().to_string();
    let until = (events - 1).to_string();
    let replay = |extra: &[&str]| {
        let mut args = vec!["sim", "replay", &file_arg, "--log-key-pin", &pin, "--until", &until];
        args.extend_from_slice(extra);
        let (code, out, err) = cli(&args, &[]);
        assert_eq!(code, 0, "{err}");
        json(&out)
    };
    let plain = replay(&[]);
    let reported = replay(&["--report", &page_arg]);
    assert_eq!(reported["stateDigest"], plain["stateDigest"], "the state at --until is the same with a report");
    assert_eq!(reported["report"], page_arg.as_str());
    check_written(dir.path(), &page, &["replay.html", "root.bcx"]);
    let html = std::fs::read_to_string(&page).unwrap();
    check_page(&html, &["mark-until"]);
    assert!(html.contains(&format!("--until {until}")), "the mark names the seq");
    assert!(html.contains(plain["stateDigest"].as_str().unwrap()), "the page names the state's digest");
    check_rendered(&page);
}
