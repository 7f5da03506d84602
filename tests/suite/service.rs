//! The HTTP service example (`examples/service.rs`) embeds a job and serves its controls:
//! started as a child process, asked for its status, scaled, paused, resumed and stopped. The
//! child is killed when the test ends, whatever happens.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Kills the child on drop.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The example binary `cargo test` built next to this test.
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    // target/<profile>/deps/<test> → target/<profile>/examples/<name>
    exe.parent()
        .and_then(|deps| deps.parent())
        .map(|profile| profile.join("examples").join(name))
        .expect("a target directory")
}

/// One HTTP/1.1 request; the status code and the body.
fn request(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("the service accepts connections");
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).expect("a response");
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    (code, body)
}

#[test]
fn the_service_example_reports_scales_and_stops_its_job() {
    let exe = example("service");
    assert!(exe.exists(), "{} was built by cargo test", exe.display());
    // Enough steps that the job outlives the test; it ends by /stop.
    let child = Command::new(&exe)
        .arg("1000000")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the example starts");
    let mut guard = Guard(child);
    let stdout = guard.0.stdout.take().expect("piped stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("a first line");
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();

    let (code, body) = request(&addr, "GET", "/status", "");
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).expect("JSON status");
    assert_eq!(status["layout"]["dp"], 2);

    let (code, _) = request(&addr, "POST", "/scale", "not a number");
    assert_eq!(code, 400);
    let (code, body) = request(&addr, "POST", "/scale", "3");
    assert_eq!(code, 202, "{body}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, body) = request(&addr, "GET", "/status", "");
        let s: serde_json::Value = serde_json::from_str(&body).expect("JSON status");
        if s["layout"]["dp"] == 3 {
            assert_eq!(s["generation"], 1);
            break;
        }
        assert!(Instant::now() < deadline, "the job did not scale to 3: {s}");
        std::thread::sleep(Duration::from_millis(50));
    }

    // Paused, the job runs no step; resumed, it trains on.
    let (code, _) = request(&addr, "POST", "/pause", "");
    assert_eq!(code, 202);
    let status = |addr: &str| -> serde_json::Value {
        serde_json::from_str(&request(addr, "GET", "/status", "").1).expect("JSON status")
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while status(&addr)["paused"] != true {
        assert!(Instant::now() < deadline, "the job did not pause");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The step that ran when the pause came may still finish, and no other: however slow the
    // machine, a second later at most one more step is done (a job that ignored the pause
    // would have run many of its millisecond steps by then).
    let steps = |addr: &str| status(addr)["steps_done"].as_u64().expect("steps_done");
    let at_pause = steps(&addr);
    std::thread::sleep(Duration::from_secs(1));
    let held = steps(&addr);
    assert!(
        held <= at_pause + 1,
        "a paused job ran steps {at_pause}..{held}"
    );
    let (code, _) = request(&addr, "POST", "/resume", "");
    assert_eq!(code, 202);
    let deadline = Instant::now() + Duration::from_secs(60);
    while steps(&addr) <= held {
        assert!(Instant::now() < deadline, "the job did not resume");
        std::thread::sleep(Duration::from_millis(50));
    }

    let (code, body) = request(&addr, "POST", "/stop", "");
    assert_eq!(code, 200, "{body}");
    let summary: serde_json::Value = serde_json::from_str(&body).expect("JSON summary");
    assert!(
        summary["steps"].as_u64().is_some_and(|s| s > 0),
        "{summary}"
    );
    // The service ends by itself after a stop.
    let deadline = Instant::now() + Duration::from_secs(30);
    while guard.0.try_wait().expect("wait").is_none() {
        assert!(Instant::now() < deadline, "the service did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}
