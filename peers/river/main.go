// Command river-bench times River (github.com/riverqueue/river), the Go job queue on
// PostgreSQL, working a backlog of no-op jobs: the peer that `loadgen bench --only river`
// measures the inbox strategy's processors against (docs/PERFORMANCE.md, "River, the Go job
// queue on PostgreSQL").
//
// One run:
//  1. drops and recreates its own database (-db, default river_bench) on the server of
//     -database-url, and migrates River's schema into it with rivermigrate;
//  2. bulk-inserts -jobs no-op jobs with InsertManyFast (COPY), untimed, into the default
//     queue, all available at once;
//  3. starts a River client with the -tuning asked for, whose one worker returns nil, and
//     waits until every job is completed: the client's completion events, checked against
//     the table once a second;
//  4. prints one JSON object: jobs/s over the first-to-last finalized_at and over the wall
//     time from Start, and the settings used.
//
// Both tunings are River's own: `default` is a client as its docs configure one (one queue of
// MaxWorkers 100, every other setting left to River's default); `tuned` is what River's own
// benchmark (`river bench`, cmd/river/riverbench) sets for the highest throughput: FetchCooldown
// 2 ms, FetchPollInterval 20 ms, MaxWorkers 2,000.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"runtime"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// NoopArgs is the job: a number, so that the args are not empty JSON.
type NoopArgs struct {
	N int `json:"n"`
}

// Kind names the job kind in river_job.kind.
func (NoopArgs) Kind() string { return "noop" }

// NoopWorker does nothing, so what is measured is River's fetching, locking and completing.
type NoopWorker struct {
	river.WorkerDefaults[NoopArgs]
}

// Work returns at once: the job is done.
func (NoopWorker) Work(context.Context, *river.Job[NoopArgs]) error { return nil }

// Tuning is the client configuration of a run, as reported.
type Tuning struct {
	Name              string  `json:"name"`
	MaxWorkers        int     `json:"max_workers"`
	FetchCooldownMs   float64 `json:"fetch_cooldown_ms"`
	FetchPollInterval float64 `json:"fetch_poll_interval_ms"`
	// The pgx pool the client and its completer share (pgxpool's default size).
	PoolMaxConns int32 `json:"pool_max_conns"`
	// River's batch completer is not configurable; its fixed settings in v0.51.2
	// (internal/jobcompleter): jobs completed by one UPDATE at most, and how often it flushes.
	Completer string `json:"completer"`
	Source    string `json:"source"`
}

func tuning(name string) (Tuning, *river.Config, error) {
	t := Tuning{
		Name:      name,
		Completer: "batch completer (River's only one, not configurable): up to 5,000 jobs per UPDATE, flushed every 50 ms once 100 wait, else every 250 ms",
	}
	cfg := &river.Config{}
	switch name {
	case "default":
		t.MaxWorkers = 100
		t.Source = "River's defaults; MaxWorkers 100 as its docs' examples configure the default queue"
	case "tuned":
		t.MaxWorkers = 2_000
		cfg.FetchCooldown = 2 * time.Millisecond
		cfg.FetchPollInterval = 20 * time.Millisecond
		t.Source = "as River's own benchmark (cmd/river/riverbench) sets them for throughput"
	default:
		return t, nil, fmt.Errorf("-tuning must be default or tuned, not %q", name)
	}
	// What the client will run with: River's defaults where unset (river.FetchCooldownDefault,
	// river.FetchPollIntervalDefault).
	cooldown, poll := cfg.FetchCooldown, cfg.FetchPollInterval
	if cooldown == 0 {
		cooldown = river.FetchCooldownDefault
	}
	if poll == 0 {
		poll = river.FetchPollIntervalDefault
	}
	t.FetchCooldownMs = float64(cooldown) / float64(time.Millisecond)
	t.FetchPollInterval = float64(poll) / float64(time.Millisecond)
	cfg.Queues = map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: t.MaxWorkers}}
	return t, cfg, nil
}

// Result is the JSON printed on stdout.
type Result struct {
	Jobs      int `json:"jobs"`
	Completed int `json:"completed"`
	// Jobs over the first-to-last finalized_at: when River's executor finished each job (set
	// in the client; the completer's UPDATE commits it up to a flush later).
	Seconds float64 `json:"seconds"`
	JobsS   float64 `json:"jobs_s"`
	// From client.Start until every job was seen completed (events, or the table).
	SecondsWall float64 `json:"seconds_wall"`
	JobsSWall   float64 `json:"jobs_s_wall"`
	// Untimed: the bulk insert of the backlog.
	InsertSeconds float64 `json:"insert_seconds"`
	Tuning        Tuning  `json:"tuning"`
	River         string  `json:"river"`
	Database      string  `json:"database"`
	GoMaxProcs    int     `json:"gomaxprocs"`
}

func main() {
	databaseURL := flag.String("database-url", os.Getenv("DATABASE_URL"), "PostgreSQL URL; the run's database is made on its server")
	dbName := flag.String("db", "river_bench", "the database to drop, create and run in")
	jobs := flag.Int("jobs", 20_000, "no-op jobs to insert and work")
	tuningName := flag.String("tuning", "default", "default or tuned")
	timeout := flag.Duration("timeout", 15*time.Minute, "give up after this long working")
	flag.Parse()
	if err := run(*databaseURL, *dbName, *jobs, *tuningName, *timeout); err != nil {
		fmt.Fprintln(os.Stderr, "river-bench:", err)
		os.Exit(1)
	}
}

func run(databaseURL, dbName string, jobs int, tuningName string, timeout time.Duration) error {
	if databaseURL == "" {
		return errors.New("no -database-url (or DATABASE_URL)")
	}
	if jobs < 1 {
		return errors.New("-jobs must be at least 1")
	}
	t, cfg, err := tuning(tuningName)
	if err != nil {
		return err
	}
	ctx := context.Background()
	runURL, err := recreateDatabase(ctx, databaseURL, dbName)
	if err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, runURL)
	if err != nil {
		return fmt.Errorf("connecting to %s: %w", dbName, err)
	}
	defer pool.Close()
	t.PoolMaxConns = pool.Config().MaxConns

	driver := riverpgxv5.New(pool)
	migrator, err := rivermigrate.New(driver, nil)
	if err != nil {
		return err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("migrating River's schema: %w", err)
	}

	workers := river.NewWorkers()
	river.AddWorker(workers, &NoopWorker{})
	cfg.Workers = workers
	// River logs at info per client start and stop; warnings and errors are what matter here.
	cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	client, err := river.NewClient(driver, cfg)
	if err != nil {
		return err
	}

	insertSeconds, err := insert(ctx, client, jobs)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "river-bench: %d jobs inserted in %.1f s; starting the client (%s)\n", jobs, insertSeconds, tuningName)

	wall, err := work(ctx, client, pool, jobs, timeout)
	if err != nil {
		return err
	}

	var completed int
	var span float64
	err = pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'completed'),
		coalesce(extract(epoch FROM max(finalized_at) - min(finalized_at)), 0)::float8
		FROM river_job`).Scan(&completed, &span)
	if err != nil {
		return err
	}
	if completed != jobs {
		return fmt.Errorf("%d of %d jobs completed", completed, jobs)
	}
	res := Result{
		Jobs:          jobs,
		Completed:     completed,
		Seconds:       round(span, 1000),
		JobsS:         rate(jobs, span),
		SecondsWall:   round(wall.Seconds(), 1000),
		JobsSWall:     rate(jobs, wall.Seconds()),
		InsertSeconds: round(insertSeconds, 10),
		Tuning:        t,
		River:         "github.com/riverqueue/river v0.51.2, riverpgxv5",
		Database:      dbName,
		GoMaxProcs:    runtime.GOMAXPROCS(0),
	}
	return json.NewEncoder(os.Stdout).Encode(res)
}

// recreateDatabase drops dbName (ending its sessions) and creates it afresh on the server of
// databaseURL; returns the URL of the new database.
func recreateDatabase(ctx context.Context, databaseURL, dbName string) (string, error) {
	conn, err := pgx.Connect(ctx, databaseURL)
	if err != nil {
		return "", fmt.Errorf("connecting to %s: %w", redact(databaseURL), err)
	}
	defer conn.Close(ctx)
	ident := pgx.Identifier{dbName}.Sanitize()
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+ident+" WITH (FORCE)"); err != nil {
		return "", fmt.Errorf("dropping %s: %w", dbName, err)
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+ident); err != nil {
		return "", fmt.Errorf("creating %s: %w", dbName, err)
	}
	u, err := url.Parse(databaseURL)
	if err != nil {
		return "", fmt.Errorf("the database URL does not parse: %w", err)
	}
	u.Path = "/" + dbName
	return u.String(), nil
}

// insert adds the backlog in batches of InsertManyFast (COPY FROM under pgx), untimed by the
// caller's measure.
func insert(ctx context.Context, client *river.Client[pgx.Tx], jobs int) (float64, error) {
	const batch = 5_000
	start := time.Now()
	params := make([]river.InsertManyParams, 0, batch)
	for i := 0; i < jobs; i += batch {
		params = params[:0]
		for j := i; j < min(i+batch, jobs); j++ {
			params = append(params, river.InsertManyParams{Args: NoopArgs{N: j}})
		}
		if _, err := client.InsertManyFast(ctx, params); err != nil {
			return 0, fmt.Errorf("inserting jobs: %w", err)
		}
	}
	return time.Since(start).Seconds(), nil
}

// work starts the client and returns the time from Start until every job was seen completed.
// Completion events are the quick signal (River's own benchmark counts them the same way); the
// table is checked once a second too, so a dropped event cannot hang the run.
func work(ctx context.Context, client *river.Client[pgx.Tx], pool *pgxpool.Pool, jobs int, timeout time.Duration) (time.Duration, error) {
	events, cancel := client.SubscribeConfig(&river.SubscribeConfig{
		ChanSize: jobs + 1_000,
		Kinds:    []river.EventKind{river.EventKindJobCompleted, river.EventKindJobFailed},
	})
	defer cancel()
	check := time.NewTicker(time.Second)
	defer check.Stop()
	deadline := time.After(timeout)

	start := time.Now()
	if err := client.Start(ctx); err != nil {
		return 0, fmt.Errorf("starting the client: %w", err)
	}
	defer func() {
		stopCtx, stop := context.WithTimeout(ctx, time.Minute)
		defer stop()
		_ = client.Stop(stopCtx)
	}()
	seen := 0
	for {
		select {
		case ev := <-events:
			if ev.Kind != river.EventKindJobCompleted {
				return 0, fmt.Errorf("job %d: %s", ev.Job.ID, ev.Kind)
			}
			seen++
			if seen == jobs {
				return time.Since(start), nil
			}
		case <-check.C:
			var open int
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM river_job WHERE state <> 'completed'").Scan(&open); err != nil {
				return 0, err
			}
			if open == 0 {
				return time.Since(start), nil
			}
		case <-deadline:
			return 0, fmt.Errorf("only %d of %d jobs completed within %s", seen, jobs, timeout)
		}
	}
}

func rate(n int, seconds float64) float64 {
	if seconds <= 0 {
		return 0
	}
	return round(float64(n)/seconds, 1)
}

func round(x, by float64) float64 {
	return float64(int64(x*by+0.5)) / by
}

// redact hides the password of a URL for an error message.
func redact(s string) string {
	u, err := url.Parse(s)
	if err != nil {
		return "the database URL"
	}
	return u.Redacted()
}
