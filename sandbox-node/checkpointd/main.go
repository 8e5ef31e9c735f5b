// Command checkpointd is the node component of a pause that keeps memory
// (docs/pause-memory.md): on each gVisor node it takes, lists and deletes
// the memory images of the node's checkpoint store for the operator.
//
//	POST   /v1/checkpoints                   {"namespace", "podUID", "key"}
//	GET    /v1/checkpoints/{namespace}/{key} the image's size, and whether this node restores it
//	DELETE /v1/checkpoints/{namespace}/{key}
//	GET    /healthz
//
// Every /v1 request carries a Kubernetes service account token (Bearer) for
// the audience --audience; the API server reviews it (TokenReview) and only
// the names in --allow pass. checkpointd itself may do nothing else with the
// API: its RBAC is `create tokenreviews`.
//
// Errors are JSON: {"error": {"code", "message"}} with the HTTP status:
// 400 invalid, 401 unauthenticated, 403 forbidden, 404 not_found,
// 409 busy (a checkpoint of that pod is under way), 500 checkpoint_failed.
package main

import (
	"bytes"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"sandbox-operator.local/sandbox-node/internal/checkpoint"
	"sandbox-operator.local/sandbox-node/internal/store"
)

const serviceAccountDir = "/var/run/secrets/kubernetes.io/serviceaccount"

func main() {
	listen := flag.String("listen", ":8450", "address to serve on")
	node := checkpoint.Flags()
	audience := flag.String("audience", "sandbox-checkpointd", "the audience callers' tokens are for")
	apiServer := flag.String("api-server", "", "the API server's URL (default: in-cluster)")
	tokenFile := flag.String("token-file", serviceAccountDir+"/token", "this component's own token, for TokenReviews")
	caFile := flag.String("ca-file", serviceAccountDir+"/ca.crt", "the API server's CA")
	endedAfter := flag.Duration("forget-ended-after", time.Hour, "drop a checkpointed pod's ended mark this long after (its pod is long gone)")
	var allowed checkpoint.Repeated
	flag.Var(&allowed, "allow", "a user name whose tokens may call (repeatable), e.g. system:serviceaccount:sandbox-system:sandbox-operator")
	flag.Parse()
	runsc, checkpoints, err := node()
	if err != nil {
		log.Fatal(err)
	}
	if len(allowed) == 0 {
		log.Fatal("--allow is required: nobody could call")
	}
	reviewer, err := newReviewer(*apiServer, *tokenFile, *caFile, *audience)
	if err != nil {
		log.Fatal(err)
	}
	server := &server{
		runsc:    runsc,
		store:    checkpoints,
		reviewer: reviewer,
		allowed:  map[string]bool{},
		busy:     map[string]bool{},
	}
	for _, name := range allowed {
		server.allowed[name] = true
	}
	go func() {
		for {
			server.store.ForgetEnded(*endedAfter)
			time.Sleep(*endedAfter / 4)
		}
	}()
	log.Printf("checkpointd: serving on %s, store %s", *listen, checkpoints)
	httpServer := &http.Server{Addr: *listen, Handler: server.routes(), ReadHeaderTimeout: 10 * time.Second}
	log.Fatal(httpServer.ListenAndServe())
}

type server struct {
	runsc    checkpoint.Runsc
	store    store.Store
	reviewer *reviewer
	allowed  map[string]bool

	mu   sync.Mutex
	busy map[string]bool // pod UIDs being checkpointed
}

func (s *server) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("POST /v1/checkpoints", s.authorized(s.take))
	mux.HandleFunc("GET /v1/checkpoints/{namespace}/{key}", s.authorized(s.describe))
	mux.HandleFunc("DELETE /v1/checkpoints/{namespace}/{key}", s.authorized(s.remove))
	return mux
}

type apiError struct {
	status  int
	code    string
	message string
}

func (e apiError) Error() string { return e.message }

func reply(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

func fail(w http.ResponseWriter, err error) {
	var known apiError
	if !errors.As(err, &known) {
		known = apiError{http.StatusInternalServerError, "internal", err.Error()}
	}
	reply(w, known.status, map[string]any{"error": map[string]string{"code": known.code, "message": known.message}})
}

func (s *server) authorized(next func(http.ResponseWriter, *http.Request) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || token == "" {
			fail(w, apiError{http.StatusUnauthorized, "unauthenticated", "a Bearer token is required"})
			return
		}
		user, err := s.reviewer.review(token)
		if err != nil {
			fail(w, err)
			return
		}
		if !s.allowed[user] {
			fail(w, apiError{http.StatusForbidden, "forbidden", fmt.Sprintf("%s may not use checkpointd", user)})
			return
		}
		if err := next(w, r); err != nil {
			fail(w, err)
		}
	}
}

type takeRequest struct {
	Namespace string `json:"namespace"`
	PodUID    string `json:"podUID"`
	Key       string `json:"key"`
}

func (s *server) take(w http.ResponseWriter, r *http.Request) error {
	var request takeRequest
	decoder := json.NewDecoder(io.LimitReader(r.Body, 4096))
	decoder.DisallowUnknownFields()
	if err := decoder.Decode(&request); err != nil {
		return apiError{http.StatusBadRequest, "invalid", "the body is not {namespace, podUID, key}: " + err.Error()}
	}
	if err := store.CheckName("namespace", request.Namespace); err != nil {
		return apiError{http.StatusBadRequest, "invalid", err.Error()}
	}
	if err := store.CheckName("checkpoint key", request.Key); err != nil {
		return apiError{http.StatusBadRequest, "invalid", err.Error()}
	}
	if _, err := store.PodSandbox(s.runsc.Root, request.PodUID); err != nil {
		return apiError{http.StatusNotFound, "not_found", err.Error()}
	}
	if !s.claim(request.PodUID) {
		return apiError{http.StatusConflict, "busy", "a checkpoint of pod " + request.PodUID + " is under way"}
	}
	defer s.release(request.PodUID)
	began := time.Now()
	taken, err := checkpoint.Take(s.runsc, s.store, request.Namespace, request.PodUID, request.Key)
	if err != nil {
		return apiError{http.StatusInternalServerError, "checkpoint_failed", err.Error()}
	}
	log.Printf("checkpointd: pod %s saved as %s (%d bytes, %s)", request.PodUID, taken.Image, taken.Bytes, time.Since(began))
	reply(w, http.StatusOK, map[string]any{
		"namespace": request.Namespace, "key": request.Key, "bytes": taken.Bytes,
		"seconds": time.Since(began).Seconds(),
	})
	return nil
}

func (s *server) claim(uid string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.busy[uid] {
		return false
	}
	s.busy[uid] = true
	return true
}

func (s *server) release(uid string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.busy, uid)
}

func (s *server) image(r *http.Request) (string, error) {
	image, err := s.store.Image(r.PathValue("namespace"), r.PathValue("key"))
	if err != nil {
		return "", apiError{http.StatusBadRequest, "invalid", err.Error()}
	}
	return image, nil
}

func (s *server) describe(w http.ResponseWriter, r *http.Request) error {
	image, err := s.image(r)
	if err != nil {
		return err
	}
	build, err := store.CompleteBuild(image)
	if err != nil {
		return apiError{http.StatusNotFound, "not_found", err.Error()}
	}
	current, err := store.RunscBuild(s.runsc.Path)
	if err != nil {
		return err
	}
	reply(w, http.StatusOK, map[string]any{
		"namespace": r.PathValue("namespace"), "key": r.PathValue("key"),
		"bytes": store.SizeOf(image), "build": build, "restorable": build == current,
	})
	return nil
}

func (s *server) remove(w http.ResponseWriter, r *http.Request) error {
	image, err := s.image(r)
	if err != nil {
		return err
	}
	partial, _ := s.store.Partial(r.PathValue("namespace"), r.PathValue("key"))
	if _, err := os.Stat(image); errors.Is(err, os.ErrNotExist) {
		return apiError{http.StatusNotFound, "not_found", "no image " + filepath.Base(image)}
	}
	if err := os.RemoveAll(image); err != nil {
		return err
	}
	_ = os.RemoveAll(partial)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// reviewer asks the API server who a token belongs to (TokenReview),
// remembering answers for ten seconds (an operator's pause is a few calls;
// a token that expires is refused ten seconds later at the most).
type reviewer struct {
	url      string
	audience string
	token    string
	tokenAt  time.Time
	file     string
	client   *http.Client

	mu    sync.Mutex
	known map[[32]byte]review
}

type review struct {
	user    string
	expires time.Time
}

func newReviewer(apiServer, tokenFile, caFile, audience string) (*reviewer, error) {
	if apiServer == "" {
		host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
		if host == "" {
			return nil, errors.New("--api-server is required outside a pod")
		}
		apiServer = "https://" + strings.Trim(host, "[]") + ":" + port
		if strings.Contains(host, ":") {
			apiServer = "https://[" + strings.Trim(host, "[]") + "]:" + port
		}
	}
	ca, err := os.ReadFile(caFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("%s holds no certificate", caFile)
	}
	return &reviewer{
		url:      strings.TrimRight(apiServer, "/") + "/apis/authentication.k8s.io/v1/tokenreviews",
		audience: audience,
		file:     tokenFile,
		client: &http.Client{
			Timeout:   10 * time.Second,
			Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}},
		},
		known: map[[32]byte]review{},
	}, nil
}

// own is this component's token, read again every minute (the kubelet rotates it).
func (v *reviewer) own() (string, error) {
	if v.token == "" || time.Since(v.tokenAt) > time.Minute {
		data, err := os.ReadFile(v.file)
		if err != nil {
			return "", err
		}
		v.token, v.tokenAt = strings.TrimSpace(string(data)), time.Now()
	}
	return v.token, nil
}

func (v *reviewer) review(token string) (string, error) {
	digest := sha256.Sum256([]byte(token))
	v.mu.Lock()
	defer v.mu.Unlock()
	if known, ok := v.known[digest]; ok && time.Now().Before(known.expires) {
		return known.user, nil
	}
	own, err := v.own()
	if err != nil {
		return "", err
	}
	body, _ := json.Marshal(map[string]any{
		"apiVersion": "authentication.k8s.io/v1",
		"kind":       "TokenReview",
		"spec":       map[string]any{"token": token, "audiences": []string{v.audience}},
	})
	request, err := http.NewRequest(http.MethodPost, v.url, bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	request.Header.Set("Authorization", "Bearer "+own)
	request.Header.Set("Content-Type", "application/json")
	response, err := v.client.Do(request)
	if err != nil {
		return "", fmt.Errorf("TokenReview: %v", err)
	}
	defer response.Body.Close()
	var answer struct {
		Status struct {
			Authenticated bool `json:"authenticated"`
			User          struct {
				Username string `json:"username"`
			} `json:"user"`
			Audiences []string `json:"audiences"`
			Error     string   `json:"error"`
		} `json:"status"`
	}
	data, _ := io.ReadAll(io.LimitReader(response.Body, 1<<20))
	if response.StatusCode != http.StatusCreated && response.StatusCode != http.StatusOK {
		return "", fmt.Errorf("TokenReview: %s: %s", response.Status, strings.TrimSpace(string(data)))
	}
	if err := json.Unmarshal(data, &answer); err != nil {
		return "", fmt.Errorf("TokenReview: %v", err)
	}
	if !answer.Status.Authenticated {
		return "", apiError{http.StatusUnauthorized, "unauthenticated", "the token is not valid for " + v.audience}
	}
	if len(v.known) > 1024 {
		v.known = map[[32]byte]review{}
	}
	v.known[digest] = review{answer.Status.User.Username, time.Now().Add(10 * time.Second)}
	return answer.Status.User.Username, nil
}
