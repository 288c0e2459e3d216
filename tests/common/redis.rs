//! A real Redis (Debian's `redis-server`, installed by `scripts/setup --tests`) on a port held for the test, which
//! the test can stop, freeze and start again on the same port.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::ports::{HeldPort, hold_port};

/// `redis-server` as a child process; killed when dropped.
pub struct RedisProcess {
    child: Option<Child>,
    port: HeldPort,
}

impl RedisProcess {
    /// Started on a held port, with no persistence; returns once it answers PING.
    pub fn start() -> RedisProcess {
        let mut redis = RedisProcess {
            child: None,
            port: hold_port(),
        };
        redis.resume_after_stop();
        redis
    }

    /// `redis://127.0.0.1:PORT/0`.
    pub fn url(&self) -> String {
        format!("redis://{}/0", self.port.address())
    }

    /// Kills it: connections to it are refused until [`Self::resume_after_stop`].
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port (empty: nothing was persisted); returns once it answers PING.
    pub fn resume_after_stop(&mut self) {
        assert!(self.child.is_none(), "redis-server is running");
        let child = Command::new("redis-server")
            .args(["--port", &self.port.port().to_string(), "--bind", "127.0.0.1"])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "no",
                "--loglevel",
                "warning",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("redis-server runs: `scripts/setup --tests` installs it");
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(10);
        while self.command(&["PING"]).as_deref() != Some("+PONG") {
            assert!(Instant::now() < until, "redis-server did not answer PING within 10 s");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Freezes it (SIGSTOP): connections stay open and nothing is answered, as a Redis that hangs.
    pub fn freeze(&self) {
        self.signal("-STOP");
    }

    /// Lets a frozen Redis run again (SIGCONT).
    pub fn thaw(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("redis-server is running").id();
        let status = Command::new("kill").args([signal, &pid.to_string()]).status().unwrap();
        assert!(status.success());
    }

    /// One command in RESP, answered with its first line (`+PONG`, `$-1`, `:3`, or a bulk string's value), or `None`
    /// when Redis does not answer within a second.
    pub fn command(&self, words: &[&str]) -> Option<String> {
        let mut stream = TcpStream::connect(self.port.address()).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
        let mut request = format!("*{}\r\n", words.len());
        for word in words {
            request.push_str(&format!("${}\r\n{word}\r\n", word.len()));
        }
        stream.write_all(request.as_bytes()).ok()?;
        let mut answer = Vec::new();
        let mut buffer = [0; 512];
        loop {
            let read = stream.read(&mut buffer).ok()?;
            if read == 0 {
                break;
            }
            answer.extend_from_slice(&buffer[..read]);
            let text = String::from_utf8_lossy(&answer);
            let complete = match text.strip_prefix('$') {
                Some(bulk) => bulk.starts_with("-1\r\n") || text.matches("\r\n").count() >= 2,
                None => text.contains("\r\n"),
            };
            if complete {
                break;
            }
        }
        let text = String::from_utf8_lossy(&answer).into_owned();
        let mut lines = text.split("\r\n");
        let first = lines.next()?.to_owned();
        if first.starts_with('$') && first != "$-1" {
            return lines.next().map(str::to_owned);
        }
        Some(first)
    }
}

impl Drop for RedisProcess {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.thaw();
        }
        self.stop();
    }
}
